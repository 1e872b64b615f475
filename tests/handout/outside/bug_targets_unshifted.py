"""Style: Hugging Face-like, no flags needed: a GPTConfig with hidden_size / num_attention_heads /
num_hidden_layers / vocab_size / max_position_embeddings, a model class named GPT whose
forward(input_ids, labels=None) returns a dict with "logits" and "loss" and, like HF causal LMs, takes
labels = input_ids and is meant to shift them inside.

Bug: the "shift" drops the first position of both the logits and the labels
(logits[:, 1:] against labels[:, 1:]), so position i is still scored against its own input token:
the targets are not shifted.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "Hugging Face-style names, dict output, labels shifted inside"
BUG = "targets not shifted: logits[:, 1:] scored against labels[:, 1:] (each position's own token)"
EXPECTED_CAUSE = r"shift"
FLAGS: list[str] = []


class GPTConfig:
    def __init__(self, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128, layer_norm_epsilon=1e-5):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_epsilon = layer_norm_epsilon


class GPTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self._shape(self.q_proj(hidden_states), tgt_len, bsz)
        key_states = self._shape(self.k_proj(hidden_states), tgt_len, bsz)
        value_states = self._shape(self.v_proj(hidden_states), tgt_len, bsz)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal_mask = torch.tril(torch.ones(tgt_len, tgt_len, dtype=torch.bool, device=hidden_states.device))
        attn_weights = attn_weights.masked_fill(~causal_mask, torch.finfo(attn_weights.dtype).min)
        attn_probs = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_probs, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output)


class GPTBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPTAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.GELU(),
                                 nn.Linear(4 * config.hidden_size, config.hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList([GPTBlock(config) for _ in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, labels=None):
        position_ids = torch.arange(input_ids.size(-1), device=input_ids.device)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            hidden_states = block(hidden_states)
        logits = self.lm_head(self.ln_f(hidden_states))
        loss = None
        if labels is not None:
            shift_logits = logits[:, 1:, :].contiguous()
            shift_labels = labels[:, 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return {"logits": logits, "loss": loss}
