"""Style: Hugging Face-like names, no flags. MiniLMConfig(hidden_size, num_attention_heads,
num_hidden_layers, vocab_size, max_position_embeddings) and MiniLMForCausalLM whose
forward(input_ids, labels=None) returns a plain dict {"logits": ..., "loss": ...}, shifting the labels
inside. Fused query_key_value projection split with torch.chunk, GELU MLP, pre-norm.

Correct. The file is meant to be checked with no flags at all (`gptlab check ok_hf_dict.py`): the
model class is the only nn.Module that maps input_ids to logits.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

STYLE = "Hugging Face-style names, dict output, no flags"
BUG = None
FLAGS: list[str] = []


class MiniLMConfig:
    def __init__(self, vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128, hidden_act="gelu"):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act


class MiniLMSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states):
        bsz, q_len, hidden = hidden_states.shape
        query, key, value = torch.chunk(self.query_key_value(hidden_states), 3, dim=-1)
        query = query.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key = key.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value = value.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal_mask = torch.full((q_len, q_len), float("-inf"), device=hidden_states.device).triu(1)
        attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_output = torch.matmul(attn_weights, value)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, hidden)
        return self.out_proj(attn_output)


class MiniLMDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size)
        self.self_attn = MiniLMSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.GELU(),
                                 nn.Linear(4 * config.hidden_size, config.hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.self_attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class MiniLMForCausalLM(nn.Module):
    config_class = MiniLMConfig

    def __init__(self, config: MiniLMConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(MiniLMDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, labels=None):
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        logits = self.lm_head(self.norm(hidden_states))
        out = {"logits": logits}
        if labels is not None:
            shifted = logits[:, :-1].reshape(-1, logits.size(-1))
            out["loss"] = F.cross_entropy(shifted, labels[:, 1:].reshape(-1))
        return out
