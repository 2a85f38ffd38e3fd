"""The EAGLE family in one place: its network (`network`: a small decoder over the policy's
features), its reduced draft vocabulary (`draft_vocab`, EAGLE-3 / FR-Spec), its loss
(`loss`, with EAGLE-3's training-time test) and the drafter that drives them behind the
drafter interface (`drafter`: cache, EAGLE-2 tree search, export in EAGLE's layout)."""

from tlt_jax.drafters.eagle.drafter import EagleDrafter
from tlt_jax.drafters.eagle.network import DrafterConfig

__all__ = ["DrafterConfig", "EagleDrafter"]
