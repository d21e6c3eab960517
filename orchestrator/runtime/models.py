"""Built-in models, in plain torch.nn."""

from __future__ import annotations

import torch
from torch import nn


class BertMLM(nn.Module):
    """A BERT-style masked-language-model encoder.

    ``forward(input_ids, labels)`` returns the mean cross-entropy over positions whose label is not -100.
    With the bert_base sizes (vocab 30522, hidden 768, 12 layers, ffn 3072, 512 positions) it has ~110M
    parameters; the output projection is tied to the token embedding, as in BERT.
    """

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, ffn_size: int,
                 max_seq_len: int, dropout: float = 0.0):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden_size)
        self.position_embedding = nn.Embedding(max_seq_len, hidden_size)
        self.embedding_norm = nn.LayerNorm(hidden_size)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden_size, num_heads, ffn_size, dropout, activation="gelu",
                                           batch_first=True, norm_first=False)
        # enable_nested_tensor=False: the fast path would change numerics between padded/unpadded inputs.
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.head_transform = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.LayerNorm(hidden_size))
        self.head_bias = nn.Parameter(torch.zeros(vocab_size))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.token_embedding(input_ids) + self.position_embedding(positions)
        hidden = self.encoder(self.dropout(self.embedding_norm(hidden)))
        logits = self.head_transform(hidden) @ self.token_embedding.weight.T + self.head_bias
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
