"""The deterministic, resumable sampler: windows of ``seq_len + 1`` tokens, sources mixed
by weight, a disjoint share for every rank.

Legend: N tokens in a split, S sequence length, B sequences per micro-batch, W windows.

One source: a split of N tokens holds W = (N - 1) // S windows. The source's k-th sample
reads window ``perm_epoch[k % W]`` with epoch = k // W and a permutation keyed by (seed,
epoch): ``torch.randperm`` up to :data:`RANDPERM_MAX` windows (as epscale always has), a
keyed Feistel permutation beyond (O(1) memory and time per index, so a terabyte corpus
costs nothing at start-up).

Mixtures: global sample g goes to source s(g), drawn from the weights by a hash of
(seed, g) - i.i.d., so the proportions hold within sampling error at every scale - and
reads that source's next sample. The state is one integer per source (samples taken
from it) plus the global position; a step's assignment depends only on them and on the
global indices, so a checkpoint resumes exactly and another rank count with the same
``world * grad_accum * B`` replays the same global batches. Changing the weights of a
run continues every source where it stopped.

Every optimizer step consumes ``world * grad_accum * B`` global samples; rank r's
micro-batch m takes a contiguous block of B of them. The validation set is fixed: the
first samples of the same kind of draw (another key), each source's windows in order.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import DataError
from .shards import ShardedTokens
from .sources import Mixture, Splits

RANDPERM_MAX = 1 << 24  # windows; above this the Feistel permutation (no O(W) table)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_VAL_SALT = 0x5EED_0F_0A1  # the validation draw's key, apart from the training draw's


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    h = np.array([0], dtype=np.uint64)
    for p in parts:
        h = _mix64(h ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF))
    return h[0]


class FeistelPermutation:
    """A keyed pseudo-random permutation of [0, n): a 4-round balanced Feistel network on
    the smallest even bit width that covers n, with cycle walking (an index that lands
    at or beyond n is permuted again; at most 4n-wide domain, under 4 walks expected)."""

    def __init__(self, n: int, key: int):
        self.n = int(n)
        half = (max(2, (self.n - 1).bit_length()) + 1) // 2
        self.half, self.mask = np.uint64(half), np.uint64((1 << half) - 1)
        self.keys = [_key(key, r) for r in range(4)]

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: np.ndarray) -> np.ndarray:
        out = self._rounds(np.asarray(i, dtype=np.uint64))
        over = out >= np.uint64(self.n)
        while over.any():
            out[over] = self._rounds(out[over])
            over = out >= np.uint64(self.n)
        return out.astype(np.int64)


class WindowSampler:
    """Deterministic windows of ``seq_len + 1`` tokens over one split.

    ``batch(first, count)`` returns samples ``first .. first+count-1`` as (inputs_BS,
    targets_BS) int64 tensors; the same index always gives the same window.
    ``shuffle=False`` reads windows in order (validation). ``id_limit``: every id read is
    checked to be below it (the model's vocab_size), naming the file when one is not.
    """

    def __init__(self, tokens, seq_len: int, seed: int, shuffle: bool = True,
                 name: str = "train", id_limit: int | None = None, source: str = "",
                 hint: str = "use more data, a shorter model.seq_len or another "
                             "data.val_fraction"):
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.id_limit, self.source = id_limit, source
        self.num_windows = (int(tokens.size) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"the {name} split has {tokens.size} tokens, fewer than "
                            f"model.seq_len + 1 = {seq_len + 1}; {hint}")
        self._perm_epoch, self._perm = -1, None

    def _epoch_perm(self, epoch: int):
        if epoch != self._perm_epoch:
            key = self.seed * 1_000_003 + epoch
            if self.num_windows <= RANDPERM_MAX:
                gen = torch.Generator().manual_seed(key)
                self._perm = torch.randperm(self.num_windows, generator=gen).numpy()
            else:
                self._perm = FeistelPermutation(self.num_windows, key)
            self._perm_epoch = epoch
        return self._perm

    def _window(self, k: int) -> int:
        epoch, i = divmod(int(k), self.num_windows)
        if not self.shuffle:
            return i
        perm = self._epoch_perm(epoch)
        return int(perm[i] if isinstance(perm, np.ndarray) else perm(np.array([i]))[0])

    def windows(self, k: np.ndarray) -> np.ndarray:
        """Window index of every sample index in ``k`` (int64)."""
        k = np.asarray(k, dtype=np.int64)
        epoch, i = np.divmod(k, self.num_windows)
        if not self.shuffle:
            return i
        out = np.empty_like(i)
        for e in np.unique(epoch):
            sel = epoch == e
            perm = self._epoch_perm(int(e))
            out[sel] = perm[i[sel]] if isinstance(perm, np.ndarray) else perm(i[sel])
        return out

    def rows(self, k: np.ndarray) -> np.ndarray:
        """The windows of sample indices ``k`` as an int64 array [len(k), S + 1]."""
        S = self.seq_len
        out = np.empty((len(k), S + 1), dtype=np.int64)
        for row, w in enumerate(self.windows(k)):
            start = int(w) * S
            out[row] = self.tokens[start:start + S + 1]
        if self.id_limit is not None and out.size and int(out.max()) >= self.id_limit:
            self._bad_id(out, k)
        return out

    def _bad_id(self, out: np.ndarray, k: np.ndarray) -> None:
        row, col = np.argwhere(out >= self.id_limit)[0]
        pos = int(self.windows(k[row:row + 1])[0]) * self.seq_len + int(col)
        if isinstance(self.tokens, ShardedTokens):
            path, offset = self.tokens.locate(pos)
            where = f"shard '{path}' at token {offset}"
        else:
            where = f"data source '{self.source}' at token {pos}"
        raise IdBeyondVocab(f"{where} holds token id {int(out[row, col])}, beyond "
                            f"model.vocab_size={self.id_limit}; the data was not made with this "
                            "tokenizer, or is damaged")

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        block_BS1 = torch.from_numpy(self.rows(np.arange(first, first + count)))
        return block_BS1[:, :-1].contiguous(), block_BS1[:, 1:].contiguous()


class IdBeyondVocab(DataError):
    """A window holds a token id the model has no embedding for (damaged data)."""


def _source_seed(seed: int, i: int) -> int:
    """Source 0 keeps ``data.seed`` (a single source samples as it always has)."""
    return seed if i == 0 else seed + 7919 * i


class DataLoader:
    """Per-rank view of the global sample stream of one source (:class:`Splits`) or a
    :class:`Mixture`, with a resumable position.

    ``next_micro_batch()`` returns this rank's next (inputs_BS, targets_BS);
    ``end_step()`` advances the global position past the whole step (all ranks, all
    micro-batches). ``state_dict()`` (the global position and the samples taken from
    each source) is what checkpoints store.
    """

    def __init__(self, data: Splits | Mixture, seq_len: int, micro_batch_size: int,
                 grad_accum: int, rank: int, world_size: int, seed: int):
        self.mixture = data if isinstance(data, Mixture) else Mixture([data])
        parts = self.mixture.parts
        self.names = [p.name or p.description for p in parts]
        self.samplers = [WindowSampler(p.train, seq_len, _source_seed(seed, i), shuffle=True,
                                       name=f"train split of {p.description}",
                                       id_limit=p.id_limit, source=p.name, hint=p.short_hint)
                         for i, p in enumerate(parts)]
        self.val_samplers = [WindowSampler(p.val, seq_len, seed, shuffle=False,
                                           name=f"validation split of {p.description}",
                                           id_limit=p.id_limit, source=p.name,
                                           hint=p.short_hint) for p in parts]
        self._cum = np.cumsum(self.mixture.weights)
        self._cum[-1] = 1.0
        self.seed, self.seq_len = seed, seq_len
        self.B, self.accum, self.rank, self.world = micro_batch_size, grad_accum, rank, world_size
        self.position = 0
        self.source_positions = np.zeros(len(parts), dtype=np.int64)
        self._micro = 0
        self._plan: tuple[int, np.ndarray, np.ndarray] | None = None
        # An id beyond the vocabulary read by this rank (the message), or None: the batch
        # is then all zeros so that this rank's collectives stay in step with the others',
        # and the trainer stops every rank after the step (see next_micro_batch).
        self.bad_data: str | None = None

    @property
    def train(self) -> WindowSampler:
        return self.samplers[0]

    @property
    def val(self) -> WindowSampler:
        return self.val_samplers[0]

    @property
    def samples_per_step(self) -> int:
        return self.world * self.accum * self.B

    # ------------------------------------------------------------------ the draw
    def choose(self, first: int, count: int, salt: int = 0) -> np.ndarray:
        """The source of global samples ``first .. first+count-1`` (int64 array)."""
        n = len(self.samplers)
        if n == 1:
            return np.zeros(count, dtype=np.int64)
        g = np.arange(first, first + count, dtype=np.uint64)
        bits = _mix64(g * _GOLDEN + _key(self.seed, salt)) >> np.uint64(11)
        u = bits.astype(np.float64) * 2.0 ** -53
        return np.minimum(np.searchsorted(self._cum, u, side="right"), n - 1).astype(np.int64)

    @staticmethod
    def _within(choice: np.ndarray, start_counts: np.ndarray) -> np.ndarray:
        """Each sample's index in its source: the source's count before it."""
        within = np.empty(choice.size, dtype=np.int64)
        for s in range(start_counts.size):
            sel = choice == s
            within[sel] = start_counts[s] + np.arange(int(sel.sum()))
        return within

    def _step_plan(self) -> tuple[int, np.ndarray, np.ndarray]:
        if self._plan is None or self._plan[0] != self.position:
            choice = self.choose(self.position, self.samples_per_step)
            self._plan = (self.position, choice, self._within(choice, self.source_positions))
        return self._plan

    def _read(self, samplers: list[WindowSampler], choice: np.ndarray,
              within: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.empty((choice.size, self.seq_len + 1), dtype=np.int64)
        for s, sampler in enumerate(samplers):
            sel = choice == s
            if sel.any():
                rows[sel] = sampler.rows(within[sel])
        block_BS1 = torch.from_numpy(rows)
        return block_BS1[:, :-1].contiguous(), block_BS1[:, 1:].contiguous()

    # ------------------------------------------------------------------ training
    def next_micro_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._micro >= self.accum:
            raise RuntimeError("next_micro_batch called more than grad_accum times in a step")
        _, choice, within = self._step_plan()
        lo = (self._micro * self.world + self.rank) * self.B
        self._micro += 1
        try:
            return self._read(self.samplers, choice[lo:lo + self.B], within[lo:lo + self.B])
        except IdBeyondVocab as e:  # only this rank may see it: raising here would leave the
            self.bad_data = str(e)  # others blocked in a collective (a traceback, exit 1)
            x_BS = torch.zeros((self.B, self.seq_len), dtype=torch.int64)
            return x_BS, x_BS.clone()

    def end_step(self) -> None:
        _, choice, _ = self._step_plan()
        self.source_positions += np.bincount(choice, minlength=len(self.samplers))
        self.position += self.samples_per_step
        self._micro = 0
        self._plan = None

    def _advance(self, count: int) -> None:
        chunk = 1 << 22
        for first in range(self.position, self.position + count, chunk):
            n = min(chunk, self.position + count - first)
            self.source_positions += np.bincount(self.choose(first, n),
                                                 minlength=len(self.samplers))
        self.position += count
        self._plan = None

    def val_batches(self, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the fixed validation set, ``num_batches`` global batches
        (``samples_per_step`` samples each): the same batches at every eval, and the same
        set at every world size that keeps the global batch (an elastic restart), split into
        ``num_batches x grad_accum`` micro-batches per rank."""
        total = num_batches * self.samples_per_step
        choice = self.choose(0, total, salt=_VAL_SALT)
        within = self._within(choice, np.zeros(len(self.samplers), dtype=np.int64))
        out = []
        for i in range(num_batches * self.accum):
            lo = (i * self.world + self.rank) * self.B
            out.append(self._read(self.val_samplers, choice[lo:lo + self.B],
                                  within[lo:lo + self.B]))
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"position": self.position, "samples_per_step": self.samples_per_step,
                "source_positions": [int(x) for x in self.source_positions],
                "sources": list(self.names)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position. The samples taken per source are matched by source path
        (by order when the paths changed but not their number; a new source starts at
        0); a checkpoint without them (one source, or written before mixtures) has them
        recomputed from the global position."""
        self.position, self._micro, self._plan = int(state["position"]), 0, None
        saved, names = state.get("source_positions"), state.get("sources")
        n = len(self.samplers)
        if saved is None or names is None:
            if n == 1:
                self.source_positions[:] = self.position
            else:
                target, self.position = self.position, 0
                self.source_positions[:] = 0
                self._advance(target)
            return
        by_name = dict(zip(names, saved))
        if all(name in by_name for name in self.names) or len(saved) != n:
            self.source_positions[:] = [int(by_name.get(name, 0)) for name in self.names]
        else:
            self.source_positions[:] = [int(x) for x in saved]


def _sample_counts(tokens, vocab_size: int, sample_tokens: int, blocks: int = 64) -> np.ndarray:
    """Token counts of a sample of a split: the first ``sample_tokens`` of an array (in
    memory or a .bin memmap, as epscale always has); for prepared shards ``blocks``
    evenly spaced blocks that total ``sample_tokens`` (the whole split when smaller)."""
    if not isinstance(tokens, ShardedTokens) or tokens.size <= sample_tokens:
        sample = np.asarray(tokens[:sample_tokens])
        return np.bincount(sample, minlength=vocab_size)[:vocab_size].astype(np.float64)
    length = sample_tokens // blocks
    counts = np.zeros(vocab_size, dtype=np.float64)
    for b in range(blocks):
        start = (b * (tokens.size - length)) // (blocks - 1)
        counts += np.bincount(tokens[start:start + length], minlength=vocab_size)[:vocab_size]
    return counts


def unigram_entropy(data: Mixture | Splits | np.ndarray, vocab_size: int,
                    sample_tokens: int = 1 << 24) -> float:
    """Entropy (nats) of the training tokens' frequency distribution - what a model
    without context can reach; the trainer prints it next to the loss. Estimated from a
    sample of at most ``sample_tokens`` per source (:func:`_sample_counts`); a mixture's
    is that of the weighted mixture of its sources' distributions."""
    if isinstance(data, Mixture):
        parts, weights = [p.train for p in data.parts], data.weights
    else:
        parts, weights = [data.train if isinstance(data, Splits) else data], [1.0]
    p = np.zeros(vocab_size, dtype=np.float64)
    for tokens, w in zip(parts, weights):
        counts = _sample_counts(tokens, vocab_size, sample_tokens)
        p += w * counts / max(counts.sum(), 1.0)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def byte_unigram_entropy(tokens: np.ndarray, vocab_size: int = 256) -> float:
    """:func:`unigram_entropy` of one token array (its first 2**24 tokens)."""
    return unigram_entropy(tokens, vocab_size)
