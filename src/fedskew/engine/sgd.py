"""Local mini-batch SGD with momentum and weight decay: ``torch.optim.SGD``'s update, element for element.

The rule itself lives in the leaf module :mod:`fedskew.update_rules`, which algorithms may import too (their
auxiliary loops on copies: FedAvg-FT / FedBABU's fine-tuning); this module keeps the engine's names. On a
CPU the result equals ``torch.optim.SGD``'s bit for bit (tests/test_engine_sgd.py).
"""

from __future__ import annotations

from fedskew.update_rules import SGD, apply_step, sgd_directions

__all__ = ["SGD", "apply_step", "sgd_directions"]
