"""The engine and prefix-cache benchmarks run and report their contracted keys."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from mlxserve.cli import main as cli_main

pytestmark = pytest.mark.slow


def test_bench_engine_reports_its_keys(tmp_path: Path, model_dir_factory) -> None:
    out = tmp_path / "engine.json"
    model = str(model_dir_factory("llama"))
    args = ["bench", "engine", "--model", model, "--tokens", "8", "--long-prompt", "256"]
    assert cli_main([*args, "--history-tokens", "256", "--rounds", "1", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    keys = (
        "engine_efficiency",
        "batch_scaling_4",
        "batch_scaling_8",
        "batch_8_vs_mlx_lm_batch_generator",
        "short_ttft_under_long_prefill",
        "itl_under_long_prefill",
        "warm_ttft_8k_over_cold_64",
        "warm_ttft_8k_over_suffix_forward",
        "suffix_forward_over_cold_64",
    )
    for key in keys:
        assert figures[key] > 0
    assert figures["rounds"] == 1 and figures["warm_hits"] >= 1  # every warm turn was a hit
    assert figures["baseline"] == "mlx_lm"


def test_bench_engine_runs_on_deepseek_v4(tmp_path: Path, model_dir_factory) -> None:
    """No mlx-lm for V4: the baseline is mlx-vlm's own loop on the same checkpoint."""
    out = tmp_path / "engine-v4.json"
    model = str(model_dir_factory("deepseek_v4"))
    args = ["bench", "engine", "--model", model, "--tokens", "6", "--long-prompt", "128"]
    assert cli_main([*args, "--history-tokens", "128", "--rounds", "1", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["baseline"] == "mlx_vlm"
    assert "batch_8_vs_mlx_lm_batch_generator" not in figures
    for key in ("engine_efficiency", "batch_scaling_4", "itl_under_long_prefill"):
        assert figures[key] > 0


def test_bench_prefix_cache_reports_its_keys(tmp_path: Path, model_dir_factory) -> None:
    out = tmp_path / "prefix.json"
    model = str(model_dir_factory("deepseek_v4"))
    args = ["bench", "prefix-cache", "--model", model, "--prefix-tokens", "256"]
    assert cli_main([*args, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["warm_over_cold"] < 1
    assert figures["entries"] == 1
    assert figures["hits"] == 7
    assert figures["prefilled_tokens_per_warm_turn"] == figures["new_tokens_per_warm_turn"]
    for key in ("cold_ttft_s", "warm_ttft_s"):
        assert figures[key] > 0


def test_bench_structured_reports_its_keys(tmp_path: Path, model_dir_factory) -> None:
    out = tmp_path / "structured.json"
    args = ["bench", "structured", "--tokens", "6", "--rounds", "2"]
    args += [f"--model={family}={model_dir_factory(family)}" for family in ("deepseek_v4", "qwen3")]
    assert cli_main([*args, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    for key in ("constrained_over_free_1", "constrained_over_free_8", "mask_ms_p99"):
        assert figures[key] > 0
    # Each family's figure is the median of its rounds' ratios; the headline, the worst.
    for n in (1, 8):
        medians = []
        for family in ("deepseek_v4", "qwen3"):
            rounds = figures[f"{family}_rounds_{n}"]
            assert len(rounds) == 2
            assert figures[f"{family}_constrained_over_free_{n}"] == pytest.approx(
                statistics.median(rounds), abs=1e-3
            )
            medians.append(figures[f"{family}_constrained_over_free_{n}"])
        assert figures[f"constrained_over_free_{n}"] == min(medians)


def test_bench_speculative_reports_its_keys(tmp_path: Path, model_dir_factory) -> None:
    out = tmp_path / "speculative.json"
    model = str(model_dir_factory("qwen3"))
    args = ["bench", "speculative", "--model", model, "--file-tokens", "40", "--rounds", "1"]
    assert cli_main([*args, "--mtp-tokens", "12", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    for key in ("ngram_speedup_copy", "ngram_speedup_adversarial", "batch4_speedup_copy"):
        assert figures[key] > 0
    # The reply re-emits the prompt's file: drafts are kept, several tokens per forward.
    assert figures["acceptance_copy"] > 0.5
    assert figures["tokens_per_forward_copy"] > 1.5
    # The tiny DeepSeek-V4 with an MTP layer: greedy tokens are the same with its drafts.
    assert figures["mtp_parity"] == 1 and figures["mtp_draft_tokens"] > 0
    assert 0 <= figures["mtp_acceptance"] <= 1 and figures["mtp_tokens_per_forward"] >= 1


def test_bench_memory_reports_its_keys(tmp_path: Path, model_dir_factory, capsys) -> None:
    out = tmp_path / "memory.json"
    model = str(model_dir_factory("llama"))
    args = ["bench", "memory", "--model", model, "--requests", "5", "--prompt-tokens", "16"]
    assert cli_main([*args, "--max-tokens", "4", "--json", str(out)]) == 0
    printed = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    for key in ("peak_cache_bytes", "budget_bytes", "preemptions", "completed"):
        assert key in printed
    figures = json.loads(out.read_text())["figures"]
    assert figures["completed"] == 5 and figures["greedy_identical"] == 5
    assert 0 < figures["peak_cache_bytes"] <= figures["budget_bytes"]


def test_bench_disk_cache_reports_its_keys(tmp_path: Path, model_dir_factory) -> None:
    """Short history here; the acceptance run uses 4-bit models and 8k tokens."""
    out = tmp_path / "disk.json"
    model = str(model_dir_factory("qwen3"))
    args = ["bench", "disk-cache", "--model", model, "--history-tokens", "1024"]
    assert cli_main([*args, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["hits"] == 7 and figures["hits_after_restart"] == 4
    for key in ("restored_ttft_over_cold", "restored_ttft_over_ram_hit", "warm_turn_ttft_s"):
        assert figures[key] > 0
    assert 0 < figures["disk_bytes"] <= figures["disk_budget_bytes"]


def test_bench_soak_reports_its_keys(tmp_path: Path, model_dir_factory) -> None:
    """A short soak on the tiny DeepSeek-V4; the acceptance run is 10 minutes, 6 agents."""
    out = tmp_path / "soak.json"
    model = str(model_dir_factory("deepseek_v4"))
    args = ["bench", "soak", "--model", model, "--minutes", "0.05", "--agents", "3"]
    assert cli_main([*args, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["unexpected_errors"] == 0, figures["unexpected_examples"]
    assert figures["requests_ok"] > 0
    assert figures["requests_failed"] == figures["bad_requests_sent"]
    assert 0 <= figures["hit_ratio"] <= 1  # the 10-minute run is where it is judged
    for key in ("ttft_p50", "ttft_p99", "rss_start_mb", "rss_end_mb", "rss_growth"):
        assert figures[key] > 0


def test_bench_status_reports_its_keys(tmp_path: Path, model_dir_factory) -> None:
    """Two streams and two rounds here; the acceptance run uses 64 streams."""
    out = tmp_path / "status.json"
    model = str(model_dir_factory("llama"))
    args = ["bench", "status", "--model", model, "--streams", "2", "--tokens", "4"]
    assert cli_main([*args, "--rounds", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["status_p99_ms"] > 0 and figures["status_polls"] > 0
    assert figures["status_poll_failures"] == 0
    assert figures["status_server_p99_ms"] > 0 and 0 < figures["status_server_share"] < 1
    assert len(figures["round_ratios"]) == 2
    assert figures["status_poll_overhead"] == pytest.approx(
        1 - statistics.median(figures["round_ratios"]), abs=1e-3
    )


def test_bench_kv_quant_reports_its_keys(tmp_path: Path, capsys) -> None:
    """Short lengths and no trained model here; the acceptance run uses the defaults."""
    out = tmp_path / "kv-quant.json"
    args = ["bench", "kv-quant", "--quality-tokens", "0", "--session-tokens", "256"]
    args += ["--long-tokens", "300", "--decode-context", "64", "--decode-steps", "2"]
    assert cli_main([*args, "--json", str(out)]) == 0
    printed = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    for key in ("kv_bytes_per_token_ratio_8", "kv_bytes_per_token_ratio_4", "peak_bytes_ratio_8"):
        assert key in printed
    figures = json.loads(out.read_text())["figures"]
    assert figures["kv_bytes_per_token_ratio_8"] <= 0.56
    assert figures["kv_bytes_per_token_ratio_4"] <= 0.31
    assert figures["sessions_admitted_ratio_8"] >= 1.7
    assert figures["peak_bytes_8"] > 0 and figures["decode_tok_s_ratio_8"] > 0


def test_bench_images_reports_its_keys(tmp_path: Path, vision_dir: Path, capsys) -> None:
    """Short history here: the figures exist and the re-sent turn is a hit that skips
    the tower; the 0.1 bound on the ratio holds at the default 4096-token history."""
    out = tmp_path / "images.json"
    args = ["bench", "images", "--model", str(vision_dir), "--history-tokens", "128"]
    assert cli_main([*args, "--rounds", "1", "--images", "1", "--json", str(out)]) == 0
    printed = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    for key in ("image_prefill_s", "resend_ttft_over_cold", "vision_tower_ms_per_image"):
        assert float(printed[key]) > 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["resend_cached_tokens"] == figures["cold_prompt_tokens"]
    assert figures["resend_tower_images"] == 0
    assert figures["image_tokens_per_prompt"] == 16
