"""A BERT encoder with a masked-LM head (Devlin et al. 2018), post-LayerNorm as published."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class BertSize:
    layers: int
    hidden: int
    heads: int
    vocab: int = 30522
    max_positions: int = 512
    type_vocab: int = 2
    dropout: float = 0.1

    @property
    def intermediate(self) -> int:
        return 4 * self.hidden


BERT_SIZES = {
    "bert_tiny": BertSize(layers=2, hidden=128, heads=2),
    "bert_base": BertSize(layers=12, hidden=768, heads=12),
    "bert_large": BertSize(layers=24, hidden=1024, heads=16),
}


class EncoderLayer(nn.Module):
    def __init__(self, size: BertSize):
        super().__init__()
        self.heads = size.heads
        self.qkv = nn.Linear(size.hidden, 3 * size.hidden)
        self.proj = nn.Linear(size.hidden, size.hidden)
        self.norm1 = nn.LayerNorm(size.hidden, eps=1e-12)
        self.ffn = nn.Sequential(
            nn.Linear(size.hidden, size.intermediate), nn.GELU(), nn.Linear(size.intermediate, size.hidden)
        )
        self.norm2 = nn.LayerNorm(size.hidden, eps=1e-12)
        self.dropout = nn.Dropout(size.dropout)
        self.attn_dropout = size.dropout

    def forward(self, x: Tensor, attn_mask: Tensor | None) -> Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.attn_dropout if self.training else 0.0
        )
        x = self.norm1(x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, t, h))))
        return self.norm2(x + self.dropout(self.ffn(x)))


class BertForMaskedLM(nn.Module):
    """Encoder plus the MLM head whose decoder shares the word-embedding matrix.

    ``forward`` returns logits over the vocabulary, or the mean cross-entropy over positions
    whose label is not -100 when ``labels`` are given.
    """

    def __init__(self, size: BertSize):
        super().__init__()
        self.size = size
        self.word = nn.Embedding(size.vocab, size.hidden)
        self.position = nn.Embedding(size.max_positions, size.hidden)
        self.token_type = nn.Embedding(size.type_vocab, size.hidden)
        self.embed_norm = nn.LayerNorm(size.hidden, eps=1e-12)
        self.dropout = nn.Dropout(size.dropout)
        self.layers = nn.ModuleList(EncoderLayer(size) for _ in range(size.layers))
        self.mlm_transform = nn.Sequential(
            nn.Linear(size.hidden, size.hidden), nn.GELU(), nn.LayerNorm(size.hidden, eps=1e-12)
        )
        self.mlm_bias = nn.Parameter(torch.zeros(size.vocab))
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, tokens: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
        per_sample: bool = False, max_predictions: int | None = None, label_smoothing: float = 0.0,
    ) -> Tensor:
        """Logits for every position; or, with ``labels``, the cross-entropy (against labels
        smoothed by ``label_smoothing``) over the positions whose label is not -100: their mean,
        or with ``per_sample`` each sample's sum, for the trainer to divide by the count of
        masked tokens in its whole global batch (``training.loop.objective.global_loss_scale``).

        With labels only the masked positions go through the vocabulary projection: the other
        ~85 % of the logits would be computed and thrown away. As reference BERT pretraining
        gathers ``max_predictions_per_seq`` positions per sequence (google-research/bert,
        run_pretraining.py, ``gather_indexes``), a fixed ``max_predictions`` positions are taken
        from each sequence, its masked ones first and padding after them (weight 0). Shapes then
        do not depend on the labels' values: selecting by value (``hidden[labels != -100]``)
        makes the host wait for the device every step to learn how many there are, and gives
        torch.compile a dynamic shape. Each sequence must have at most ``max_predictions`` masked
        positions (:func:`training.data.datasets.mask_tokens` masks at most that many); None takes them all.
        """
        hidden = self.encode(tokens, attention_mask)
        if labels is None:
            return self.mlm_logits(hidden)
        length = labels.shape[1]
        count = length if max_predictions is None else min(max_predictions, length)
        positions = (labels != -100).float().topk(count, dim=1, sorted=False).indices  # [batch, count]
        picked = labels.gather(1, positions)
        states = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        token_loss = nn.functional.cross_entropy(self.mlm_logits(states).flatten(0, 1).float(), picked.flatten(),
                                                 ignore_index=-100, reduction="none",
                                                 label_smoothing=label_smoothing).view_as(picked)
        if per_sample:
            return token_loss.sum(1)
        return token_loss.sum() / (picked != -100).sum().clamp(min=1)

    def encode(self, tokens: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word(tokens) + self.position(positions) + self.token_type(torch.zeros_like(tokens))
        x = self.dropout(self.embed_norm(x))
        # Padding mask (1 = real token) broadcast over heads and query positions.
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """The MLM head: transform, then the decoder that shares the word embeddings."""
        return self.mlm_transform(hidden) @ self.word.weight.T + self.mlm_bias


def bert(name: str) -> BertForMaskedLM:
    return BertForMaskedLM(BERT_SIZES[name])
