"""The TensorFlow fused reduction reuses a result array only once nothing else holds it
(TensorFlow adopts the arrays it is given and keeps them as long as their tensors live)."""
import numpy as np
import pytest

pytest.importorskip("tensorflow")

from ringsync.tensorflow import fused  # noqa: E402


def test_a_result_array_is_reused_only_when_released():
    like = np.zeros(1000, np.float32)
    first = fused._free_output("pool.test", like)
    assert first.ctypes.data % fused._ALIGN == 0 and first.shape == like.shape
    held = first  # as TensorFlow holds an array it adopted
    second = fused._free_output("pool.test", like)
    assert second is not held
    first_id = id(first)
    del first, held  # released: the next call takes it again
    third = fused._free_output("pool.test", like)
    assert id(third) == first_id and third is not second  # (second is still held)
    del third
    again = fused._free_output("pool.test", like)
    assert again.shape == like.shape
    other = fused._free_output("pool.test", np.zeros(7, np.float64))  # another layout
    assert other.shape == (7,) and other.dtype == np.float64
    assert len(fused._outputs["pool.test"]) <= fused._POOL
