"""Style: Hugging Face-like. A TinyGPTConfig with hidden_size, num_attention_heads, num_hidden_layers,
intermediate_size, vocab_size, max_position_embeddings and layer_norm_eps; TinyGPTAttention,
TinyGPTMLP, TinyGPTLayer, TinyGPTModel and TinyGPTForCausalLM; forward(input_ids, labels=None) returns
a CausalLMOutput with .logits and .loss, shifting the labels inside (labels = input_ids).

Correct.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import CrossEntropyLoss

STYLE = "Hugging Face-style config and CausalLM output"
BUG = None
FLAGS = ["--model", "TinyGPTForCausalLM(TinyGPTConfig(vocab_size=11, hidden_size=16, num_attention_heads=2, "
         "num_hidden_layers=2, max_position_embeddings=16))"]


class TinyGPTConfig:
    model_type = "tinygpt"

    def __init__(self, vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=None, max_position_embeddings=1024, layer_norm_eps=1e-5,
                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        for key, value in kwargs.items():
            setattr(self, key, value)


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple | None = None


class TinyGPTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions),
            persistent=False,
        )

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, output_attentions=False):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        q_len = attention_scores.size(-2)
        causal = self.causal_mask[:, :, :q_len, :q_len]
        mask_value = torch.finfo(attention_scores.dtype).min
        attention_scores = torch.where(causal, attention_scores,
                                       torch.full_like(attention_scores, mask_value))
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        output = self.dense(context_layer)
        return (output, attention_probs) if output_attentions else (output,)


class TinyGPTMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states):
        return self.dropout(self.fc_out(self.act(self.fc_in(hidden_states))))


class TinyGPTLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = TinyGPTAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = TinyGPTMLP(config)

    def forward(self, hidden_states):
        residual = hidden_states
        attn_outputs = self.attention(self.input_layernorm(hidden_states))
        hidden_states = residual + attn_outputs[0]
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states,)


class TinyGPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([TinyGPTLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids):
        seq_length = input_ids.shape[1]
        position_ids = torch.arange(seq_length, dtype=torch.long, device=input_ids.device).unsqueeze(0)
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)[0]
        return self.final_layernorm(hidden_states)


class TinyGPTForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = TinyGPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, labels=None):
        hidden_states = self.model(input_ids)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss_fct = CrossEntropyLoss()
            loss = loss_fct(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return CausalLMOutput(loss=loss, logits=logits)
