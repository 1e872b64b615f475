"""ModelConfig validation: every bad value is refused with a message naming the field and the fix."""

from __future__ import annotations

import pytest

from gptlab.config import ModelConfig


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_embd": 100, "n_head": 3}, "n_embd=100 is not divisible by n_head=3"),
        ({"norm": "batchnorm"}, "norm='batchnorm' is not one of"),
        ({"arrangement": "sandwich"}, "arrangement='sandwich'"),
        ({"ffn": "tanh"}, "ffn='tanh'"),
        ({"positions": "alibi"}, "positions='alibi'"),
        ({"attention": "flash"}, "attention='flash'"),
        ({"positions": "rope", "n_embd": 6, "n_head": 2}, "needs an even head size"),
        ({"n_layer": 0}, "n_layer=0 must be positive"),
        ({"n_head": -1}, "n_head=-1 must be positive"),
        ({"vocab_size": 0}, "vocab_size=0 must be positive"),
        ({"block_size": 0}, "block_size=0 must be positive"),
        ({"n_embd": 0}, "n_embd=0 must be positive"),
        ({"dropout": 1.0}, "dropout=1.0 must be in [0, 1)"),
        ({"n_layer": "4"}, "n_layer='4' must be of type int"),
        ({"n_layer": True}, "n_layer=True must be of type int"),
        ({"tied": 1}, "tied=1 must be of type bool"),
        ({"ffn_mult": 0.001}, "gives no feed-forward units"),
    ],
)
def test_bad_config_names_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match="ModelConfig") as info:
        ModelConfig(**changes)
    assert message in str(info.value)


def test_unknown_key_is_refused_with_the_known_fields() -> None:
    with pytest.raises(ValueError, match="unknown ModelConfig field.*n_layers.*known fields are: vocab_size"):
        ModelConfig.from_dict({"n_layers": 2})


def test_dict_round_trip_and_replace() -> None:
    config = ModelConfig(n_layer=2, positions="rope", tied=False, ffn_mult=2)
    assert config.ffn_mult == 2.0 and isinstance(config.ffn_mult, float)
    assert ModelConfig.from_dict(config.to_dict()) == config
    changed = config.replace(n_head=2)
    assert changed.n_head == 2 and changed.n_layer == 2
    with pytest.raises(ValueError, match="n_head=3"):
        config.replace(n_head=3)


def test_derived_sizes() -> None:
    config = ModelConfig(n_embd=96, n_head=6, ffn_mult=2.5)
    assert config.head_size == 16
    assert config.ffn_hidden == 240
