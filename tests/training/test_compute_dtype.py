"""`speckv train-draft --dtype`: bfloat16 only where this CPU times it clearly faster."""

from __future__ import annotations

import pytest
import torch

from speckv.training.compute_dtype import CLEAR_SHARE, choose_dtype, gemm_seconds, training_dtype


def test_bfloat16_is_chosen_only_where_it_is_clearly_faster():
    fp32 = 1e-3
    assert choose_dtype({torch.float32: fp32, torch.bfloat16: 0.5 * fp32}) == torch.bfloat16
    # emulated bfloat16 (several times slower) and a near tie both keep float32
    assert choose_dtype({torch.float32: fp32, torch.bfloat16: 7 * fp32}) == torch.float32
    assert choose_dtype({torch.float32: fp32, torch.bfloat16: CLEAR_SHARE * fp32 * 1.01}
                        ) == torch.float32
    assert choose_dtype({torch.float32: fp32}) == torch.float32


def test_gemm_seconds_times_each_dtype_on_a_small_shape():
    seconds = gemm_seconds(shape=(4, 32, 64))
    assert set(seconds) == {torch.float32, torch.bfloat16}
    assert all(s >= 0 for s in seconds.values())


def test_dtype_names_resolve_and_a_wrong_one_names_the_flag():
    assert training_dtype("float32") == torch.float32
    assert training_dtype("bfloat16") == torch.bfloat16
    assert training_dtype("auto") in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="--dtype"):
        training_dtype("float8")
