"""Curvature: K-FAC / EK-FAC factors and dense Fisher blocks, fitted once, saved, re-damped for free."""

from .blocks import DenseBlock, KronBlock, blocks_for
from .covariance import CovarianceCallback, EigenCorrectionCallback
from .curvature import Curvature, CurvatureError, DenseEigen, KronEigen
from .fit import fit_curvature
from .pca import KFACBasis, pca_basis, pca_logra

__all__ = ["Curvature", "CurvatureError", "KronEigen", "DenseEigen", "KronBlock", "DenseBlock", "blocks_for",
           "CovarianceCallback", "EigenCorrectionCallback", "KFACBasis", "fit_curvature", "pca_basis", "pca_logra"]
