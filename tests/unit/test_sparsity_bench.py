"""bench/sparsity_gpu.py on the CPU: the 2:4 magnitude pruning the GPU measurement relies on
(exactly 2 of every 4 consecutive values along K kept, the 2 largest in magnitude, unchanged),
and the clear exit (status 2, one line, no result file) where there is no CUDA."""
from __future__ import annotations

import pytest
import torch

from bench import sparsity_gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prune_2_4_keeps_the_two_largest_of_every_four(dtype):
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    p = sparsity_gpu.prune_2_4(w)
    assert p.shape == w.shape and p.dtype == w.dtype
    groups, kept = w.view(48, 16, 4), p.view(48, 16, 4)
    nonzero = kept != 0
    assert bool((nonzero.sum(-1) == 2).all())
    assert torch.equal(kept[nonzero], groups[nonzero])  # kept values unchanged
    # every kept magnitude >= every dropped one, within each group
    mags = groups.abs().float()
    low_kept = mags.masked_fill(~nonzero, float("inf")).amin(-1)
    high_dropped = mags.masked_fill(nonzero, -1.0).amax(-1)
    assert bool((low_kept >= high_dropped).all())


def test_prune_2_4_groups_run_along_the_last_dimension():
    w = torch.tensor([[1.0, -5.0, 3.0, 0.5, 9.0, 8.0, -7.0, 6.0]])
    assert sparsity_gpu.prune_2_4(w).tolist() == [[0.0, -5.0, 3.0, 0.0, 9.0, 8.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="multiple of 4"):
        sparsity_gpu.prune_2_4(torch.ones(4, 6))


def test_without_cuda_it_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "s.json"
    with pytest.raises(SystemExit) as exc:
        sparsity_gpu.main(["--out", str(out)])
    assert exc.value.code == 2 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA" in err
