"""The engine's tunable settings as one value (what `Communicator.tune` applies on every
rank at the same point, and what autotune searches over). Pure data: no native import."""
import dataclasses
from typing import List, Optional

NEVER = 1 << 60  # a crossover nothing reaches: the native core's size limit (RS_MAX_BYTES)


@dataclasses.dataclass(frozen=True)
class Settings:
    fusion_threshold: int
    cycle_time_ms: float
    small_allreduce_bytes: int
    staged_bytes: int
    # Whether an adapter reduces gradients during backward, agreed by every rank: read by
    # the adapters, not the engine (Communicator.overlaps; None: the adapter's own rule).
    overlap: Optional[bool] = True

    def native(self) -> List[int]:
        """The values of a tune request, in the order of RS_TUNE_* (ringsync.h)."""
        return [int(self.fusion_threshold), int(round(self.cycle_time_ms * 1000)),
                int(self.staged_bytes), int(self.small_allreduce_bytes)]

    @classmethod
    def from_native(cls, values, overlap: Optional[bool]) -> "Settings":
        fusion, cycle_us, staged, small = (int(v) for v in values)
        return cls(fusion, cycle_us / 1000, small, staged, overlap)

    def but(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)
