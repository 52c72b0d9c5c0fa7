"""Which slice of each Hugging Face-named weight a tensor-parallel rank holds (no torch).

Rank ``r`` of ``n`` (Megatron-style, as the peers do):

    q_proj            rows of query heads [r*Hq/n, (r+1)*Hq/n)          column-parallel
    k_proj, v_proj    rows of KV heads [r*Hk/n, (r+1)*Hk/n); when Hk < n, the one head
                      r*Hk//n (replicated: n/Hk ranks hold each head)   column-parallel
    o_proj            the columns of rank r's query heads                row-parallel
    gate/up_proj      rows [r*I/n, (r+1)*I/n)                           column-parallel
    down_proj         those columns                                      row-parallel
    embed_tokens      vocabulary rows [r*Vp, min((r+1)*Vp, V)), Vp = ceil(V/n), zero rows
    lm_head           pad the last shard to Vp                           vocab-parallel
    norms             whole (replicated)

Query head ``j`` attends with KV head ``j // (Hq/Hk)``; with the ranges above every rank's
query heads use exactly its KV heads, so attention needs no communication. A rank's
projections output its slice (column) or a partial sum over its slice (row, all-reduced).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_shardable(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside [0, {self.size})")

    # ------------------------------------------------------------ local sizes
    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        c = self.config
        if c.num_kv_heads >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank * c.num_kv_heads // self.size

    @property
    def kv_heads(self) -> tuple[int, int]:
        """This rank's KV heads ``[start, end)`` of the model's."""
        return self.kv_head_start, self.kv_head_start + self.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        v = self.vocab_per_rank
        return min(self.rank * v, self.config.vocab_size), min((self.rank + 1) * v,
                                                               self.config.vocab_size)

    # ---------------------------------------------------------------- slices
    def slices(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The index of ``name`` (HF name, full ``shape``) this rank holds; None: all of it."""
        del shape  # the rules depend on the name; the shape is checked by the model
        hd = self.config.head_dim
        leaf = name.rsplit(".", 2)[-2] if "." in name else name
        if leaf == "q_proj":
            a = self.rank * self.num_heads * hd
            return (slice(a, a + self.num_heads * hd),)
        if leaf in ("k_proj", "v_proj"):
            a = self.kv_head_start * hd
            return (slice(a, a + self.num_kv_heads * hd),)
        if leaf == "o_proj":
            a = self.rank * self.num_heads * hd
            return (slice(None), slice(a, a + self.num_heads * hd))
        if leaf in ("gate_proj", "up_proj"):
            a = self.rank * self.intermediate_size
            return (slice(a, a + self.intermediate_size),)
        if leaf == "down_proj":
            a = self.rank * self.intermediate_size
            return (slice(None), slice(a, a + self.intermediate_size))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            a, b = self.vocab_range
            return (slice(a, b),)
        return None

    def pad_rows(self, name: str) -> int:
        """Zero rows appended to ``name``'s slice (the last vocabulary shard)."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            a, b = self.vocab_range
            return self.vocab_per_rank - (b - a)
        return 0

    def take(self, name: str, shape: tuple[int, ...], read):
        """``read(index)`` (index None: the whole tensor) -> this rank's tensor for ``name``,
        padded. ``read`` is the loader's: a safetensors slice reads only those bytes."""
        t = read(self.slices(name, tuple(shape)))
        pad = self.pad_rows(name)
        if pad:
            import torch
            t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
        t = t.contiguous()
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()  # a view into the whole tensor would keep all of it alive
        return t


def check_shardable(c: ModelConfig, n: int) -> None:
    """ValueError naming what does not divide, for a model that cannot run on ``n`` ranks."""
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
    if n == 1:
        return
    if c.num_heads % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's "
                         f"{c.num_heads} attention heads")
    if c.num_kv_heads % n and n % c.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {n} and the model's {c.num_kv_heads} KV heads: "
                         "one must divide the other")
    if c.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's "
                         f"intermediate size {c.intermediate_size}")
