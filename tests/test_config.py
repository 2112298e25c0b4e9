import json

import pytest

from k3.config import PRESETS, ModelConfig
from k3.hf_config import from_hf_config, to_hf_config
from k3.model import count_parameters


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hf_config(name):
    config = ModelConfig.from_preset(name)
    hf = json.loads(json.dumps(to_hf_config(config)))
    assert from_hf_config(hf).to_dict() == config.to_dict()
    assert ModelConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()


def test_one_based_layer_lists():
    config = ModelConfig.from_preset("k3")
    assert config.num_layers == 93
    assert config.layer_types.count("mla") == 24 and config.layer_types.count("kda") == 69
    assert [i + 1 for i, t in enumerate(config.layer_types) if t == "mla"][:3] == [4, 8, 12]
    assert config.layer_types[92] == "mla"  # the last layer is global


def test_kimi_linear_hf_config_is_read():
    kda = [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]
    hf = {"model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
          "num_attention_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512, "num_experts": 256,
          "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
          "intermediate_size": 9216, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
          "linear_attn_config": {"kda_layers": kda, "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                                 "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4}}
    config = from_hf_config(hf)
    preset = ModelConfig.from_preset("kimi-linear-48b")
    for field in ("layer_types", "kda_gate", "kda_output_gate", "mla_output_gate", "attn_res_block_size",
                  "moe_latent_size", "hidden_act", "q_lora_rank", "routed_scaling_factor"):
        assert getattr(config, field) == getattr(preset, field), field


@pytest.mark.parametrize("bad, message", [
    (dict(full_attn_layers=[0, 2]), "1-based"),
    (dict(kda_gate="clamp"), "kda_gate"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_experts_per_tok=99), "num_experts_per_tok"),
    (dict(layer_types=["kda", "attn", "kda", "mla"]), "unknown"),
])
def test_bad_configs_say_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_preset("debug", **bad)


def test_unknown_model_type_is_rejected():
    with pytest.raises(ValueError, match="unknown model_type"):
        from_hf_config({"model_type": "llama", "vocab_size": 10})


def test_k3_parameter_counts_match_the_release():
    counts = count_parameters(ModelConfig.from_preset("k3"))
    assert counts["total_params"] == pytest.approx(2.78e12, rel=3e-3)
    assert counts["active_params"] == pytest.approx(104.2e9, rel=3e-3)


def test_kimi_linear_parameter_count_matches_transformers():
    counts = count_parameters(ModelConfig.from_preset("kimi-linear-48b"))
    # transformers' KimiLinearForCausalLM for this config has 49,122,675,072 parameters
    # (checked against transformers below when it is installed); active 3.107B without the embedding.
    assert counts["total_params"] == 49_122_675_072
    assert counts["active_params"] == pytest.approx(3.107e9, rel=1e-3)


def test_kimi_linear_count_equals_transformers_model():
    transformers = pytest.importorskip("transformers")
    import torch

    kda = [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]
    hf_config = transformers.KimiLinearConfig(linear_attn_config=dict(
        kda_layers=kda, full_attn_layers=[4, 8, 12, 16, 20, 24, 27], head_dim=128, num_heads=32,
        short_conv_kernel_size=4))
    with torch.device("meta"):
        reference = transformers.KimiLinearForCausalLM(hf_config)
    expected = sum(p.numel() for p in reference.parameters())
    assert count_parameters(ModelConfig.from_preset("kimi-linear-48b"))["total_params"] == expected


# `k3 info` in this process: a subprocess spent ~5 s importing k3 per test; `python -m k3` itself is run by
# tests/test_cli_careless_input.py.
def test_info_cli_json(capsys):
    from k3.cli import main

    assert main(["info", "--preset", "k3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total_params"] == count_parameters(ModelConfig.from_preset("k3"))["total_params"]
    assert report["active_params"] < report["total_params"]


def test_info_cli_rejects_unknown_preset(capsys):
    from k3.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["info", "--preset", "huge"])
    assert exited.value.code != 0 and "invalid choice" in capsys.readouterr().err
