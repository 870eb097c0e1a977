"""Model zoo: every model exposes ``features(x) -> z`` and ``head(z) -> logits``.

Importing this package registers every model.
"""

from fedskew.models import fedbn_cnn, pfllib_cnn, resnet50, vision_language, zoo  # noqa: F401  (registers)
from fedskew.models.base import MODELS, FedModel, count_parameters

__all__ = ["MODELS", "FedModel", "count_parameters"]
