"""A causal byte-level language model on ``torch.nn.TransformerEncoder``.

Bytes (vocabulary 256) and positions are embedded, run through a pre-norm
``nn.TransformerEncoder`` under a causal mask (each position sees itself and earlier ones),
normalised and mapped back to 256 logits. The default size, the ``stdlib_lm`` workload's:
6 layers x d_model 512, 8 heads, feed-forward 2048, context 64 bytes, no dropout:
19,210,496 parameters in 78 tensors.

    >>> model = ByteTransformer(layers=2, d_model=64, heads=4, context=16)
    >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
    torch.Size([3, 16, 256])
"""
import torch
from torch import nn

VOCABULARY = 256


class ByteTransformer(nn.Module):
    """Next-byte logits ``(batch, seq, 256)`` for byte tensors ``(batch, seq)``, ``seq <= context``."""

    def __init__(self, layers=6, d_model=512, heads=8, context=64, dropout=0.0):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(VOCABULARY, d_model)
        self.position = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=dropout,
                                           batch_first=True, norm_first=True)
        # nested tensors serve padding masks, which a causal model over full windows never has
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCABULARY)
        # not persistent: derived from context, so not in state_dict nor broadcast
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, tokens):
        seq = tokens.shape[1]
        hidden = self.embed(tokens) + self.position(torch.arange(seq))
        hidden = self.encoder(hidden, mask=self.causal_mask[:seq, :seq], is_causal=True)
        return self.head(self.norm(hidden))
