"""Attribution quality: metrics (LDS, leave-one-out correlation, recall@k), retraining ground truth with a
cache, small deterministic tasks, and :func:`evaluate`, which scores methods on a task.

Sign convention, as everywhere in gradtrace: a positive score means the training example helps the query;
LDS outcomes are ``-loss`` and leave-one-out effects are positive for helpful examples, so good methods
correlate positively.
"""

from .benchmark import INHERIT, RANDOM, MethodSpec, Row, evaluate, format_table, unsupported
from .groundtruth import GroundTruth, StaleGroundTruth, build_lds_ground_truth, build_loo_ground_truth, subset_masks
from .metrics import LDSResult, QueryMetric, lds, loo_correlation, pearson, recall_at_k, summarize
from .tasks import TASKS, DigitsMLPTask, DigitsTask, Task, TinyLMTask, get_task

__all__ = [
    "INHERIT",
    "RANDOM",
    "TASKS",
    "DigitsMLPTask",
    "DigitsTask",
    "GroundTruth",
    "LDSResult",
    "MethodSpec",
    "QueryMetric",
    "Row",
    "StaleGroundTruth",
    "Task",
    "TinyLMTask",
    "build_lds_ground_truth",
    "build_loo_ground_truth",
    "evaluate",
    "format_table",
    "get_task",
    "lds",
    "loo_correlation",
    "pearson",
    "recall_at_k",
    "subset_masks",
    "summarize",
    "unsupported",
]
