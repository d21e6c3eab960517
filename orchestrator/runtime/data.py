"""Built-in datasets. Every sample is a pure function of (seed, index), so any rank at any world size can
rebuild exactly the samples the global sampler assigns it, and a resumed run sees what it would have seen.

A sample is a dict: ``input_ids`` (masked tokens), ``labels`` (-100 except at masked positions) and
``sample_id`` (the dataset index, used to prove that no sample is skipped or trained twice).
"""

from __future__ import annotations

import fsspec
import torch
from torch.utils.data import Dataset

MASK_TOKEN = 0  # token ids 1..vocab_size-1 carry data; 0 is [MASK]
IGNORE = -100


def mask_tokens(tokens: torch.Tensor, generator: torch.Generator, mask_prob: float) -> dict[str, torch.Tensor]:
    """BERT-style masking: ``mask_prob`` of positions (at least one) are replaced by MASK and predicted."""
    masked = torch.rand(tokens.shape, generator=generator) < mask_prob
    if not masked.any():
        masked[torch.randint(len(tokens), (1,), generator=generator)] = True
    labels = torch.where(masked, tokens, torch.full_like(tokens, IGNORE))
    return {"input_ids": torch.where(masked, torch.full_like(tokens, MASK_TOKEN), tokens), "labels": labels}


class SyntheticTokens(Dataset):
    """Each sample repeats a short random motif (2 to 8 tokens drawn from a skewed, Zipf-like distribution):
    random per sample yet learnable (frequent tokens first, then copying from one period away), so the loss
    visibly falls within a few dozen steps. No files, no downloads."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0, mask_prob: float = 0.15):
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size
        self.seed, self.mask_prob = seed, mask_prob
        self._token_weights = 1.0 / torch.arange(1, vocab_size, dtype=torch.float64)  # Zipf(1) over ids 1..V-1

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        period = int(torch.randint(2, 9, (1,), generator=g))
        motif = torch.multinomial(self._token_weights, period, replacement=True, generator=g) + 1
        tokens = motif.repeat(self.seq_len // period + 1)[: self.seq_len]
        return {**mask_tokens(tokens, g, self.mask_prob), "sample_id": torch.tensor(index)}


class TextFileTokens(Dataset):
    """A text file read once through fsspec (any URL), as byte-level tokens in fixed-length sequences."""

    def __init__(self, url: str, seq_len: int, vocab_size: int, seed: int = 0, mask_prob: float = 0.15):
        with fsspec.open(url, "rb") as f:
            raw = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
        n = len(raw) // seq_len
        if n == 0:
            raise ValueError(f"data.dataset.url={url!r} holds {len(raw)} bytes, fewer than one sequence of {seq_len}")
        self.sequences = (raw[: n * seq_len] % (vocab_size - 1) + 1).view(n, seq_len)
        self.seed, self.mask_prob = seed, mask_prob

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return {**mask_tokens(self.sequences[index], g, self.mask_prob), "sample_id": torch.tensor(index)}
