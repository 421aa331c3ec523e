"""The loss a captured gradient is the gradient of: per-example loss functions, the convention that names them, and
the likelihoods a true Fisher samples labels from.

* :mod:`.functions` -- ``loss_fn(model, batch) -> [B]`` losses (:data:`LossFn`: ``causal_lm_loss``,
  ``classification_loss``, ``regression_loss``) and :class:`LossConvention`;
* :mod:`.likelihoods` -- the distributions of a model's outputs (``categorical``, ``gaussian``);
* :mod:`.preference` -- the per-pair DPO loss of preference pairs (:class:`DPO` settings, :class:`DPOLoss`).

The package sits on the floor (it imports nothing else from gradtrace), so every layer may use it.
"""

from . import likelihoods as likelihoods
from .functions import (
    MODEL_KEYS,
    LossConvention,
    LossFn,
    causal_lm_loss,
    classification_loss,
    default_loss_labels,
    lm_labels,
    regression_loss,
    token_cross_entropy,
)
from .preference import DPO, DPOLoss

__all__ = ["DPO", "DPOLoss", "MODEL_KEYS", "LossConvention", "LossFn", "causal_lm_loss", "classification_loss",
           "default_loss_labels", "likelihoods", "lm_labels", "regression_loss", "token_cross_entropy"]
