"""Distilling a draft head at export (flare/distill/): deterministic under a seed, shipped in the
package whole or not at all, and shown by `flare inspect`."""

from __future__ import annotations


import pytest
from tests.package_commands import flare
import torch

from flare.distill import export as distill_export
from flare.distill.distill import DistillOptions, distill_head
from flare.distill.prompts import PROMPT_SET_NAME, distill_prompts
from flare.preparation.export import ExportOptions
from flare.package.directory import open_package
from flare.scheduler.scheduler import Scheduler, SchedulerOptions

TINY = DistillOptions(
    draft_tokens=2, tokens=1500, seconds=120, prompt_limit=8, answer_tokens=16, draft_vocab_size=256, window=32, batch=4
)


def test_the_prompt_set_holds_every_kind_of_conversation_and_a_held_out_tenth():
    prompts = distill_prompts()
    assert len(prompts) > 200
    assert sum(p.held_out for p in prompts) == len(prompts) // 10
    assert any(len(p.messages) > 3 for p in prompts)  # multi-turn
    assert any("Python" in p.messages[-1]["content"] for p in prompts)  # code


def test_distillation_is_deterministic_under_a_seed(tiny_package):
    package = open_package(tiny_package)
    info_a, head_a = distill_head(package, TINY)
    info_b, head_b = distill_head(package, TINY)
    _, head_c = distill_head(package, DistillOptions(**{**TINY.__dict__, "seed": 1}))
    assert set(head_a) == set(head_b)
    assert all(torch.equal(head_a[name], head_b[name]) for name in head_a)
    assert not torch.equal(head_a["mtp.fc.weight"], head_c["mtp.fc.weight"])
    assert info_a.held_out == info_b.held_out and info_a.held_out is not None
    assert info_a.trained["positions"] >= 0.9 * TINY.tokens and info_a.trained["generated_tokens"] > 0
    assert info_a.draft_vocab_size == 256 and head_a["mtp.draft_vocab"].numel() == 256
    assert len(info_a.held_out.per_step) == 2


def test_a_budget_too_short_to_generate_training_answers_is_an_option_error(tiny_hf_directory, tmp_path, capsys):
    # 0.3 s: the held-out answers, generated first, take the whole generation budget.
    code = flare("export", str(tiny_hf_directory), "-o", str(tmp_path / "pkg"), "--drafter", "mtp",
                 "--distill-seconds", "0.3", "--distill-tokens", "100")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "no training answer was generated" in err and "--distill-seconds" in err
    assert "Traceback" not in err
    assert not (tmp_path / "pkg").exists()


def test_export_ships_the_head_and_inspect_shows_it(tiny_hf_directory, tmp_path, capsys):
    out = tmp_path / "pkg"
    manifest = distill_export.export_with_draft_head(str(tiny_hf_directory), out, ExportOptions(draft_tokens=2), TINY)
    package = open_package(out)
    assert manifest.serving.drafter == "auto" and package.manifest.draft_head == manifest.draft_head
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]  # no hidden target package left behind
    assert flare("inspect", str(out)) == 0
    text = capsys.readouterr().out
    assert "speculation         auto drafter, 2 draft tokens per round" in text
    assert "draft steps K       2" in text
    assert f"parameters          {manifest.draft_head.parameters:,} (bfloat16), draft vocabulary 256 tokens" in text
    assert f"distilled on        {PROMPT_SET_NAME} (8 conversations" in text
    assert "held-out acceptance" in text and "tokens per round at K" in text
    # The package serves with its head.
    scheduler = Scheduler.from_package(package, SchedulerOptions())
    assert scheduler.drafter_name == "auto"  # the head, n-gram lookup beside it


def test_an_interrupted_distillation_leaves_no_package(tiny_hf_directory, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_export, "distill_head", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill_export.export_with_draft_head(str(tiny_hf_directory), tmp_path / "pkg", ExportOptions(), TINY)
    assert list(tmp_path.iterdir()) == []


def test_distill_options_without_the_mtp_drafter_are_an_option_error(tiny_hf_directory, tmp_path, capsys):
    code = flare("export", str(tiny_hf_directory), "-o", str(tmp_path / "pkg"), "--distill-tokens", "100")
    assert code == 2
    assert capsys.readouterr().err == "flare export: error: --distill-tokens applies to --drafter mtp only\n"
    assert not (tmp_path / "pkg").exists()


def test_features_recorded_during_generation_are_those_of_a_forward_over_the_answer(tiny_package):
    """Hidden states and top-k logits taken from the rounds that generated an answer equal one
    target forward over the whole conversation."""
    from flare.distill import distill
    from flare.engine.batch import ForwardBatch, ForwardRow
    from flare.engine.kv_cache import KVCache
    from flare.engine.tokenizer import Tokenizer

    package = open_package(tiny_package)
    recorder = distill.FeatureRecorder()
    scheduler = Scheduler.from_package(package, SchedulerOptions(draft_tokens=0, prefix_cache=False), round_observer=recorder)
    conversations = distill.generate_answers(
        scheduler, Tokenizer.from_package(package), distill_prompts()[:3], TINY, distill.Progress(None), 1e12, recorder
    )
    model = scheduler.target_model
    config = model.config
    for c in conversations:
        n = c.computed  # every position but the last sampled token's, which was never fed
        assert n >= len(c.tokens) - 1
        assert c.labelled[c.prompt_len - 1 : n].all() and not c.labelled[: c.prompt_len - 1].any()
        kv = KVCache(num_layers=config.num_layers, num_blocks=32, block_size=16, num_kv_heads=config.num_kv_heads,
                     head_dim=config.head_dim)
        logits, hidden = model.forward_hidden(ForwardBatch.build([ForwardRow(c.tokens[:n], 0, tuple(range(32)), n)], 16), kv)
        torch.testing.assert_close(c.hidden[:n].float(), hidden.to(torch.bfloat16).float(), atol=0.05, rtol=0.02)
        top = logits[c.prompt_len - 1 :].topk(8, dim=-1).indices
        assert (c.top_ids[c.prompt_len - 1 : n, :1] == top[:, :1]).float().mean() > 0.95
