"""The fit stage: what is fitted once over a store or a model and then reused by every query.

``curvature/`` holds the K-FAC / EK-FAC factors and dense Fisher blocks (:func:`fit_curvature`, :class:`Curvature`);
``methods/`` the attribution methods, one file each, with their own fits (TRAK's kernel, TrackStar's second
moment: :func:`save_fit` / :func:`load_fit`) and the preconditioning the scoring engine applies. The names of both
are importable from here.
"""

from .curvature import *  # noqa: F403 - the stage's names, listed below
from .curvature import __all__ as _curvature_names
from .methods import *  # noqa: F403
from .methods import __all__ as _method_names

__all__ = [*_curvature_names, *_method_names]
