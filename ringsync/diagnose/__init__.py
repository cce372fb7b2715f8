"""ringsync.diagnose: what the files ranks write when something goes wrong say, read back
on any machine (standard library only; the native core need not be built).

- ringsync.diagnose.trace: flight records (``DIR/rank-<R>.json``), the last collectives each
  rank saw before it failed; ``describe_divergence`` says where the ranks parted
  (``ringsync trace DIR``).
- ringsync.diagnose.hang: hang report parts (``DIR/hang-<id>-rank-<R>.json``), one per rank
  that answered; ``format_hang_report`` merges them into one report (``ringsync report DIR``).

This module only hands names on.
"""

from ringsync.diagnose.hang import count_hang_parts, format_hang_report, load_hang_parts
from ringsync.diagnose.trace import describe_divergence, load_flight_records

__all__ = ["count_hang_parts", "describe_divergence", "format_hang_report", "load_flight_records",
           "load_hang_parts"]
