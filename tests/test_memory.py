import pytest


def test_budget_needs_a_gpu(monkeypatch):
    import torch

    from nb_helpers.plan.budget import enforce_budget

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        enforce_budget(4.0)


@pytest.mark.gpu
def test_budget_caps_the_allocator_context_included():
    import torch

    from nb_helpers.plan.budget import enforce_budget

    budget = enforce_budget(4.0)
    assert 0.1 < budget.context_gib < 1.5  # measured, not assumed
    assert abs(budget.context_gib + budget.allocator_cap_gib - 4.0) < 1e-6
    import gc

    gc.collect()
    torch.cuda.empty_cache()  # cached free blocks would be released on demand; what is still held counts too
    held = torch.cuda.memory_reserved() / 2**30  # (earlier GPU tests in this process: cuBLAS workspaces)
    fits = torch.empty(int((budget.allocator_cap_gib - held - 0.3) * 2**30), dtype=torch.uint8, device="cuda")
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(int(0.6 * 2**30), dtype=torch.uint8, device="cuda")  # would cross the cap
    del fits
    torch.cuda.empty_cache()


def test_a_snapshot_reads_the_allocator_s_statistics_once(monkeypatch):
    """metrics.jsonl takes a snapshot at every step: the four allocator figures come from one memory_stats() (each of
    torch.cuda.memory_allocated() and its siblings builds all of them), and mean what those functions return."""
    import torch

    from nb_helpers.plan import memory

    calls = []
    stats = {"allocated_bytes.all.current": 1 * 2**30, "reserved_bytes.all.current": 2 * 2**30,
             "reserved_bytes.all.peak": 3 * 2**30, "allocated_bytes.all.peak": 4 * 2**30}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: calls.append(1) or stats)
    monkeypatch.setattr(memory, "process_used_bytes", lambda index=0: 5 * 2**30)
    snap = memory.memory_snapshot()
    assert len(calls) == 1
    assert (snap["torch_allocated_gib"], snap["torch_reserved_gib"], snap["torch_peak_gib"],
            snap["torch_peak_allocated_gib"], snap["device_used_gib"]) == (1, 2, 3, 4, 5)
