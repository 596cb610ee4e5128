"""The connector's copies on the CPU, and the CUDA path's refusal where no GPU has run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hicache.connectors import gpu_check
from hicache.connectors.kv_copy import (
    CUDA_REFUSAL,
    NO_BLOCK,
    NO_PAGE,
    BlockCopier,
    PoolRef,
    StateCopier,
    kv_problem,
    state_problem,
)
from hicache.connectors.kv_copy_cuda import CudaBlockCopier, block_first
from hicache.memory.pools import segment_tensor
from hicache.memory.shm import SharedSegment, TensorSpec

BLOCKS, HEADS, BS, DIM, LAYERS, PAGES = 12, 2, 4, 8, 3, 10


@pytest.fixture
def pool():
    elems = HEADS * BS * 2 * DIM
    page_bytes = LAYERS * elems * 4
    name = f"hicache-test-kvcopy-{os.getpid()}"
    seg = SharedSegment.create(name, PAGES * page_bytes)
    pages = segment_tensor(seg, TensorSpec(name, (PAGES, LAYERS, elems), "float32"))
    pages.copy_(torch.randn(pages.shape, generator=torch.Generator().manual_seed(1)))
    try:
        yield PoolRef("inst", name, seg.directory, PAGES, page_bytes), pages
    finally:
        del pages
        seg.unlink()
        seg.close()


def test_loads_and_saves_move_exactly_the_named_pages_and_blocks(pool) -> None:
    ref, pages = pool
    layers = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    assert kv_problem(layers, BLOCKS, HEADS * BS * 2 * DIM * 4, torch.float32) is None
    copier = BlockCopier(layers)
    copier.attach(ref)
    src, dst = [3, 4, 5, 9, 0], [7, 8, 9, 1, 11]  # a run and scattered pages
    assert copier.load(src, [dst]) == len(src) * LAYERS * HEADS * BS * 2 * DIM * 4
    for i, layer in enumerate(layers):
        for p, b in zip(src, dst, strict=True):
            assert torch.equal(layer[b].reshape(-1), pages[p, i])
        untouched = [b for b in range(BLOCKS) if b not in dst]
        assert not layer[untouched].any()
    before = pages.clone()
    copier.save([[7, 1]], [2, 6])
    assert torch.equal(pages[2], before[3]) and torch.equal(pages[6], before[9])
    others = [p for p in range(PAGES) if p not in (2, 6)]
    assert torch.equal(pages[others], before[others])
    with pytest.raises(ValueError, match="out of range"):
        copier.load([PAGES], [[0]])
    with pytest.raises(ValueError, match="out of range"):
        copier.save([[BLOCKS]], [0])
    with pytest.raises(ValueError, match="KV cache groups"):
        copier.load([1], [[1], [2]])
    copier.detach()


def test_each_layer_copies_its_groups_blocks_and_a_window_group_loads_only_what_it_holds(pool) -> None:
    """Layers 0 and 2 in group 0 (full attention), layer 1 in group 1 (a sliding window that
    holds no block for the first page): each layer's block comes from its own group's list."""
    ref, pages = pool
    layers = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    copier = BlockCopier(layers, [0, 1, 0])
    copier.attach(ref)
    src, full, window = [2, 3, 4], [1, 2, 3], [NO_BLOCK, 6, 7]
    block_bytes = HEADS * BS * 2 * DIM * 4
    assert copier.load(src, [full, window]) == (3 * 2 + 2) * block_bytes
    for i in (0, 2):
        for p, b in zip(src, full, strict=True):
            assert torch.equal(layers[i][b].reshape(-1), pages[p, i])
        assert not layers[i][[b for b in range(BLOCKS) if b not in full]].any()
    for p, b in zip(src[1:], window[1:], strict=True):
        assert torch.equal(layers[1][b].reshape(-1), pages[p, 1])
    assert not layers[1][[b for b in range(BLOCKS) if b not in (6, 7)]].any()  # page 2's layer 1 went nowhere
    before = pages.clone()
    copier.save([[1, 2], [6, 7]], [8, 9])
    # page 8: layers 0 and 2 from full block 1 (page 2's), layer 1 from window block 6 (page 3's)
    assert torch.equal(pages[8, 0], before[2, 0]) and torch.equal(pages[8, 2], before[2, 2])
    assert torch.equal(pages[8, 1], before[3, 1]) and torch.equal(pages[9, 1], before[4, 1])
    with pytest.raises(ValueError, match="out of range"):  # a save needs every group's block
        copier.save([[1], [NO_BLOCK]], [5])
    assert torch.equal(pages[5], before[5])
    copier.detach()


def test_a_load_split_by_layer_copies_one_layer_per_call_and_the_same_bytes_as_one_load(pool) -> None:
    """``layer_loads``: layer ``i``'s call copies layer ``i`` only (two groups, as above); the
    calls together leave the blocks as ``load`` does; bad indices raise before any copy."""
    ref, pages = pool
    split = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    whole = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    by_layer, at_once = BlockCopier(split, [0, 1, 0]), BlockCopier(whole, [0, 1, 0])
    by_layer.attach(ref)
    at_once.attach(ref)
    src, full, window = [2, 3, 4, 8], [1, 2, 3, 9], [NO_BLOCK, 6, 7, 5]
    calls = by_layer.layer_loads(src, [full, window])
    assert len(calls) == LAYERS and not any(t.any() for t in split)  # nothing copied yet
    copied = 0
    for i, call in enumerate(calls):
        copied += call()
        assert [bool(t.any()) for t in split] == [j <= i for j in range(LAYERS)]
    assert copied == at_once.load(src, [full, window])
    assert all(torch.equal(a, b) for a, b in zip(split, whole, strict=True))
    with pytest.raises(ValueError, match="out of range"):
        by_layer.layer_loads([2], [[BLOCKS], [NO_BLOCK]])
    by_layer.detach()
    at_once.detach()


def test_tensor_parallel_ranks_each_copy_their_heads_of_every_page(pool) -> None:
    """Two ranks of one head each save and load their slice of a page: together they write
    exactly the page one rank of both heads writes, and each loads back only its heads."""
    ref, pages = pool
    torch.manual_seed(3)
    whole = [torch.randn(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    shards = [[t[:, r : r + 1].contiguous() for t in whole] for r in range(HEADS)]
    ranks = [BlockCopier(shards[r], rank=r, ranks=HEADS) for r in range(HEADS)]
    single = BlockCopier(whole)
    for c in (*ranks, single):
        c.attach(ref)
    single.save([[1, 2]], [0, 1])
    expected = pages[:2].clone()
    pages[:2] = 0
    assert ranks[0].save([[1, 2]], [0, 1]) == 2 * LAYERS * BS * 2 * DIM * 4  # one head's bytes
    assert not torch.equal(pages[:2], expected)  # rank 1's heads are not written yet
    ranks[1].save([[1, 2]], [0, 1])
    assert torch.equal(pages[:2], expected)
    for r, c in enumerate(ranks):
        for t in shards[r]:
            t.zero_()
        c.load([0, 1], [[5, 6]])
        for i, t in enumerate(shards[r]):
            assert torch.equal(t[5:7], whole[i][1:3, r : r + 1]) and not t[:5].any()
    with pytest.raises(ValueError, match="rank 2"):
        BlockCopier(shards[0], rank=2, ranks=2)
    for c in (*ranks, single):
        c.detach()


def test_layouts_the_copier_cannot_map_are_refused() -> None:
    good = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)]
    nbytes = HEADS * BS * 2 * DIM * 4
    assert "first axis" in kv_problem([torch.zeros(2, BLOCKS, BS, HEADS, DIM)], BLOCKS, nbytes, torch.float32)
    assert "dtype" in kv_problem(good, BLOCKS, nbytes, torch.bfloat16)
    assert "holds" in kv_problem(good, BLOCKS, nbytes * 2, torch.float32)
    strided = torch.zeros(BLOCKS, HEADS, 2 * BS, 2 * DIM)[:, :, ::2]
    assert "contiguous" in kv_problem([strided], BLOCKS, nbytes, torch.float32)


def test_block_first_views_of_both_layouts() -> None:
    flash = torch.arange(2 * BLOCKS * BS * HEADS * DIM).reshape(2, BLOCKS, BS, HEADS, DIM)
    view = block_first(flash, BLOCKS)
    assert view.shape == (BLOCKS, 2, BS, HEADS, DIM)
    assert torch.equal(view[5, 1], flash[1, 5])
    plain = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)
    assert block_first(plain, BLOCKS) is plain
    with pytest.raises(ValueError, match="no block axis"):
        block_first(torch.zeros(3, 5), BLOCKS)


def test_the_cuda_path_is_refused_where_it_has_not_run() -> None:
    assert "has not run on a GPU" in CUDA_REFUSAL
    with pytest.raises(ValueError, match="CUDA KV tensors only"):
        CudaBlockCopier([torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)], BLOCKS)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run python -m hicache.connectors.gpu_check instead")
    r = subprocess.run([sys.executable, "-m", "hicache.connectors.gpu_check"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stdout


SMALL_CHECK = ["--pages", "32", "--copy-pages", "11", "--blocks", "64", "--repeats", "1", "--layers", "4",
               "--heads", "2", "--head-dim", "32"]


def test_gpu_check_runs_every_copy_mode_with_inline_streams_on_the_cpu() -> None:
    """The check a GPU machine runs, here on the CPU: every mode, both layouts, both cases."""
    r = subprocess.run([sys.executable, "-m", "hicache.connectors.gpu_check", "--device", "cpu", *SMALL_CHECK],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["modes"] == list(gpu_check.MODES) == ["sync", "layer", "async"]
    for layout in ("block_first", "flash"):
        for mode in gpu_check.MODES:
            for case in ("runs", "scattered"):
                assert out[f"{layout}_{mode}_{case}"] == "bitwise equal"
        assert out[f"{layout}_bandwidth"]["load_gbps"] > 0


def test_gpu_check_fails_a_copier_that_loses_pages(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A load that skips its last run of pages, and a save one page off: every mode says so."""
    from hicache.connectors import kv_copy_cuda

    real_runs, real_save = kv_copy_cuda.page_runs, CudaBlockCopier.save
    monkeypatch.setattr(kv_copy_cuda, "page_runs", lambda a, b: real_runs(a, b)[:-1] or real_runs(a, b))
    assert gpu_check.main(["--device", "cpu", *SMALL_CHECK]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and all("layer 0 differs" in out[f"flash_{m}_scattered"] for m in gpu_check.MODES)

    monkeypatch.setattr(kv_copy_cuda, "page_runs", real_runs)
    monkeypatch.setattr(CudaBlockCopier, "save",
                        lambda self, blocks, pages, after=None: real_save(self, blocks, [p - 1 for p in pages], after))
    assert gpu_check.main(["--device", "cpu", *SMALL_CHECK]) == 1
    out = json.loads(capsys.readouterr().out)
    for m in gpu_check.MODES:
        assert out[f"block_first_{m}_runs"].startswith("save: layer 0 differs")


def _pool_of(name: str, pages: int, layers: int, seed: int) -> tuple[PoolRef, torch.Tensor, SharedSegment | None]:
    """A pool of ``pages`` pages of ``layers`` layer blocks, random contents (no segment for 0 layers)."""
    elems = HEADS * BS * 2 * DIM
    if not layers:
        return PoolRef("inst", name, "/dev/shm", pages, 0), torch.empty(pages, 0, elems), None
    seg = SharedSegment.create(name, pages * layers * elems * 4)
    t = segment_tensor(seg, TensorSpec(name, (pages, layers, elems), "float32"))
    t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
    return PoolRef("inst", name, seg.directory, pages, layers * elems * 4), t, seg


def test_window_layers_copy_the_window_parts_of_the_pages_that_have_one() -> None:
    """Layers 0 and 2 full (group 0), layer 1 with a window (group 1): a page's full part is
    layers 0 and 2 in the L2 pool, its window part layer 1 in the window pool, and only the
    pages named with a window part copy it; a held window block without one fails the load
    before anything is copied, and a window part without a held block fails the save."""
    full_ref, full, full_seg = _pool_of(f"hicache-test-full-{os.getpid()}", PAGES, 2, 1)
    win_ref, win, win_seg = _pool_of(f"hicache-test-win-{os.getpid()}", 4, 1, 2)
    assert full_seg is not None and win_seg is not None
    try:
        layers = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
        copier = BlockCopier(layers, [0, 1, 0], window=[False, True, False])
        with pytest.raises(RuntimeError, match="window pool"):
            copier.attach(full_ref)
        copier.attach(full_ref, win_ref)
        block_bytes = HEADS * BS * 2 * DIM * 4
        with pytest.raises(ValueError, match="no window part"):
            copier.load([2, 3, 4], [[1, 2, 3], [5, 6, 7]], [NO_PAGE, 0, 1])  # block 5 is held: it needs one
        assert not any(layer.any() for layer in layers)
        assert copier.load([2, 3, 4], [[1, 2, 3], [NO_BLOCK, 6, 7]], [NO_PAGE, 0, 1]) == (3 * 2 + 2) * block_bytes
        for p, b in zip([2, 3, 4], [1, 2, 3], strict=True):
            assert torch.equal(layers[0][b].reshape(-1), full[p, 0]) and torch.equal(layers[2][b].reshape(-1), full[p, 1])
        assert torch.equal(layers[1][6].reshape(-1), win[0, 0]) and torch.equal(layers[1][7].reshape(-1), win[1, 0])
        assert not layers[1][[b for b in range(BLOCKS) if b not in (6, 7)]].any()
        before_full, before_win = full.clone(), win.clone()
        assert copier.save([[1, 2], [NO_BLOCK, 7]], [8, 9], [NO_PAGE, 3]) == (2 * 2 + 1) * block_bytes
        assert torch.equal(full[8, 0], before_full[2, 0]) and torch.equal(full[9, 1], before_full[3, 1])
        assert torch.equal(win[3, 0], before_win[1, 0])  # block 7 held window page 1's layer
        assert torch.equal(win[:3], before_win[:3])
        with pytest.raises(ValueError, match="no block of its window group"):
            copier.save([[1], [NO_BLOCK]], [5], [2])
        with pytest.raises(ValueError, match="window parts"):
            copier.load([1, 2], [[1, 2], [NO_BLOCK, NO_BLOCK]], [NO_PAGE])
        copier.detach()
    finally:
        for seg in (full_seg, win_seg):
            seg.unlink()
            seg.close()


def test_a_model_whose_every_layer_has_the_window_keeps_no_full_part() -> None:
    """Every layer windowed: the full parts are zero bytes (no segment to map), and the
    window parts hold every layer."""
    full_ref, _, _ = _pool_of("hicache-test-nofull", PAGES, 0, 0)
    win_ref, win, win_seg = _pool_of(f"hicache-test-allwin-{os.getpid()}", 4, 2, 3)
    assert win_seg is not None
    try:
        layers = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(2)]
        copier = BlockCopier(layers, [0, 0], window=[True, True])
        copier.attach(full_ref, win_ref)
        block_bytes = HEADS * BS * 2 * DIM * 4
        assert copier.load([0, 1, 2], [[NO_BLOCK, 4, 5]], [NO_PAGE, 2, 3]) == 2 * 2 * block_bytes
        assert torch.equal(layers[1][5].reshape(-1), win[3, 1])
        copier.detach()
    finally:
        win_seg.unlink()
        win_seg.close()


def test_states_copy_every_state_layers_bytes_of_one_block_and_skip_vllms_padding() -> None:
    """State layers as vLLM's CPU GDN keeps them: per layer one byte tensor whose blocks are
    padded to the attention page (a block is a strided slice); a state is each layer's block
    bytes, the padding not kept. A state group beside attention groups is not a BlockCopier's."""
    blocks, padded, state = 6, 40, 24
    raw = [torch.zeros(blocks, padded, dtype=torch.int8) for _ in range(2)]
    layers = [[r[:, :state].view(blocks, 1, 1, state)] for r in raw]  # strided: padding after each block
    for i, r in enumerate(raw):
        r.copy_(torch.randint(-100, 100, r.shape, generator=torch.Generator().manual_seed(i), dtype=torch.int8))
    assert state_problem(layers, blocks, state) is None
    assert "bytes of state" in (state_problem(layers, blocks, state + 1) or "")
    slots = 3
    name = f"hicache-test-state-{os.getpid()}"
    seg = SharedSegment.create(name, slots * 2 * state)
    try:
        pool = segment_tensor(seg, TensorSpec(name, (slots, 2, state), "uint8"))
        copier = StateCopier(layers, [1, 1])  # both layers in KV cache group 1
        copier.attach(PoolRef("inst", name, seg.directory, slots, 2 * state))
        assert copier.save([NO_BLOCK, 4], 2) == 2 * state
        for i, r in enumerate(raw):
            assert torch.equal(pool[2, i], r[4, :state].view(torch.uint8))
        before = [r.clone() for r in raw]
        assert copier.load(2, [NO_BLOCK, 1]) == 2 * state
        for i, r in enumerate(raw):
            assert torch.equal(r[1, :state], before[i][4, :state])  # the state, into block 1
            assert torch.equal(r[1, state:], before[i][1, state:])  # the padding untouched
            others = [b for b in range(blocks) if b != 1]
            assert torch.equal(r[others], before[i][others])
        with pytest.raises(ValueError, match="out of range"):
            copier.load(2, [NO_BLOCK, NO_BLOCK])  # no block for the state group
        with pytest.raises(ValueError, match="out of range"):
            copier.save([NO_BLOCK, 1], slots)
        del pool
        copier.detach()
    finally:
        seg.unlink()
        seg.close()
    # two ranks: each copies its share of every layer's state, side by side in one slot
    shares = [[[torch.full((blocks, state), 10 * r + i, dtype=torch.int8)] for i in range(2)] for r in range(2)]
    name = f"hicache-test-state2-{os.getpid()}"
    seg = SharedSegment.create(name, slots * 2 * 2 * state)
    try:
        pool = segment_tensor(seg, TensorSpec(name, (slots, 2, 2 * state), "uint8"))
        ref = PoolRef("inst", name, seg.directory, slots, 2 * 2 * state)
        ranks = [StateCopier(shares[r], [0, 0], rank=r, ranks=2) for r in range(2)]
        for c in ranks:
            c.attach(ref)
            c.save([3], 1)
        for i in range(2):
            assert torch.equal(pool[1, i, :state], torch.full((state,), i, dtype=torch.uint8))
            assert torch.equal(pool[1, i, state:], torch.full((state,), 10 + i, dtype=torch.uint8))
        shares[1][0][0].zero_()
        ranks[1].load(1, [5])
        assert torch.equal(shares[1][0][0][5], torch.full((state,), 10, dtype=torch.int8))
        del pool
        for c in ranks:
            c.detach()
    finally:
        seg.unlink()
        seg.close()
    attention = [torch.zeros(blocks, HEADS, BS, 2 * DIM)]
    kv = BlockCopier(attention, [0], num_groups=2)  # group 1 holds state layers: no block of it is copied
    assert len(kv.group_layers) == 2 and kv.group_layers[1] == []
