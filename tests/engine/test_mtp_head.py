"""The learned draft head: its package file, and its paged runtime against the dense math it is
trained with (the same drafts and the same q)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.mtp_heads import head_info, head_module, repeat_head_state

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.drafters.mtp import HeadRow, MtpHead
from flare.engine.kv_cache import KVCache
from flare.engine.model import DecoderModel
from flare.package.directory import PackageError, open_package, write_package


@pytest.fixture(scope="module")
def draft_vocab(package_parts):
    return torch.arange(0, package_parts["config"].vocab_size, 7)


def test_a_draft_head_round_trips_through_the_package(package_parts, draft_vocab, tmp_path):
    config = package_parts["config"]
    state = head_module(config, package_parts["state_dict"], draft_vocab, seed=3).state_for_package()
    info = head_info(config, int(draft_vocab.numel()), 4, dtype="bfloat16")
    serving = package_parts["serving"].__class__(max_context=512, drafter="mtp", draft_tokens=4)
    write_package(tmp_path / "pkg", **{**package_parts, "serving": serving}, draft_head=(info, state))
    package = open_package(tmp_path / "pkg")
    assert package.manifest.draft_head == info
    assert "draft_head.safetensors" in package.manifest.files
    loaded = package.load_draft_head()
    assert set(loaded) == set(state)
    assert torch.equal(loaded["mtp.draft_vocab"], draft_vocab)
    for name, tensor in state.items():
        if tensor.is_floating_point():
            assert loaded[name].dtype == torch.bfloat16
            assert torch.equal(loaded[name], tensor.to(torch.bfloat16)), name
    # 2H*H projection, one decoder block, two norms: the head's own parameters.
    h, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    assert info.parameters == 2 * h * h + h * (q + 2 * kv) + q * h + 3 * h * f + 4 * h


def test_a_draft_head_that_does_not_fit_the_model_is_refused(package_parts, draft_vocab, tmp_path):
    config = package_parts["config"]
    state = head_module(config, package_parts["state_dict"], draft_vocab).state_for_package()
    state["mtp.fc.weight"] = state["mtp.fc.weight"][:, :-1]
    serving = package_parts["serving"].__class__(max_context=512, drafter="mtp", draft_tokens=4)
    with pytest.raises(PackageError, match=r"mtp.fc.weight has shape"):
        write_package(
            tmp_path / "pkg", **{**package_parts, "serving": serving},
            draft_head=(head_info(config, int(draft_vocab.numel()), 4), state),
        )
    assert not (tmp_path / "pkg").exists()


def test_a_package_that_lost_its_draft_head_file_is_refused(make_package, package_parts, draft_vocab):
    config = package_parts["config"]
    state = head_module(config, package_parts["state_dict"], draft_vocab).state_for_package()
    path = make_package(
        serving={"drafter": "mtp", "draft_tokens": 2}, draft_head=(head_info(config, int(draft_vocab.numel()), 2), state)
    )
    (path / "draft_head.safetensors").unlink()
    with pytest.raises(PackageError, match="draft_head.safetensors is missing"):
        open_package(path)


# A target of another family: its layers have what a Llama layer lacks, its head's does not.
FAMILY_LAYER = {"attention_bias": True, "qk_norm": True, "sliding_window": 8, "sliding_layers": (0,), "sandwich_norms": True,
                "hidden_activation": "gelu_tanh", "attention_softcap": 20.0}


@pytest.mark.parametrize("drafted_after_prefill", [True, False], ids=["caught-up-each-round", "caught-up-late"])
@pytest.mark.parametrize("imported", [False, True], ids=["distilled", "imported"])
@pytest.mark.parametrize(
    ("native", "family"), [(True, False), (False, False), (False, True)], ids=["native-kernels", "torch", "torch-family-target"]
)
def test_the_paged_head_drafts_what_the_dense_head_computes(
    package_parts, make_state_dict, draft_vocab, native, family, imported, drafted_after_prefill
):
    """A prompt chunk, then a decode row that drafts K steps on the head's own hidden states:
    tokens and q equal the dense unrolled forward fed the same tokens, whether the head caught up
    on the chunk in its own round or on everything at once from the pooled hidden states. An
    imported head reads the target's hidden state after its final norm and has a norm of its own.
    Over a target of another family the head's block is still the Llama layer it is trained as."""
    from flare.engine import native as native_module

    if native and not native_module.available():
        pytest.skip("the native kernels are not built")
    config, target_state = package_parts["config"], package_parts["state_dict"]
    if family:
        config = replace(config, **FAMILY_LAYER)
        target_state = make_state_dict(config)
    target = DecoderModel(config, target_state, native_kernels=native)
    head_state = repeat_head_state(config, target_state, draft_vocab, mix=1.0, seed=5)
    target_norm = target_state["model.norm.weight"]
    final_norm = 1.0 + torch.rand(config.hidden_size, generator=torch.Generator().manual_seed(2)) if imported else target_norm
    module = head_module(config, target_state, draft_vocab, final_norm=final_norm, reads_final_norm=imported)
    module.load_package_state(head_state)
    embed = target_state["model.embed_tokens.weight"]
    head = MtpHead(config, head_state, target, embed[draft_vocab].contiguous(), final_norm,
                   num_blocks=8, block_size=16, target_norm=target_norm if imported else None)
    kv = KVCache(num_layers=config.num_layers, num_blocks=8, block_size=16, num_kv_heads=config.num_kv_heads,
                 head_dim=config.head_dim)
    tokens = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    table = tuple(range(8))
    chunk = 30
    with torch.inference_mode():
        batch = ForwardBatch.build([ForwardRow(tokens[:chunk], 0, table, 1)], 16)
        _, hidden = target.forward_hidden(batch, kv)
        head.write_hidden(batch.slot_mapping, hidden)
        if drafted_after_prefill:  # the chunk's row "sampled" tokens[chunk] and drafted one step
            row = HeadRow(0, table, tuple(tokens[:chunk]), device_tokens=1, sample_index=0, steps=1)
            head.run([row], torch.tensor([[tokens[chunk]]]), torch.tensor([1]))
        # A decode row: the target "sampled" tokens[chunk + 1] (with a temperature: q is softmax(logits / T)).
        batch = ForwardBatch.build([ForwardRow([tokens[chunk]], chunk, table, 1)], 16)
        _, hidden = target.forward_hidden(batch, kv)
        head.write_hidden(batch.slot_mapping, hidden)
        first = chunk + 1 if drafted_after_prefill else 0
        row = HeadRow(first, table, tuple(tokens[first : chunk + 1]), device_tokens=1, sample_index=0, steps=3,
                      temperature=0.7, seed=9)
        drafts = head.run([row], torch.tensor([[tokens[chunk + 1]]]), torch.tensor([1]))
    assert drafts is not None
    proposed = [int(t) for t in drafts.tokens[0]]
    sequence = tokens[: chunk + 2] + proposed[:2]
    with torch.no_grad():
        kv_dense = KVCache(num_layers=config.num_layers, num_blocks=8, block_size=16, num_kv_heads=config.num_kv_heads,
                           head_dim=config.head_dim)
        _, dense_hidden = target.forward_hidden(ForwardBatch.build([ForwardRow(sequence, 0, table, 1)], 16), kv_dense)
        outputs = module.unrolled(dense_hidden.unsqueeze(0), torch.tensor(sequence).unsqueeze(0), 3)
    for j in range(3):
        q = torch.softmax(module.logits(outputs[j][0, chunk + 1 + j]) / 0.7, -1)
        torch.testing.assert_close(drafts.probs[0, j], q, atol=2e-5, rtol=1e-3)
        assert q[drafts.tokens[0, j] == draft_vocab].item() > 0  # the draft is one q can propose


def pooled_head(package_parts, draft_vocab) -> MtpHead:
    """A runtime head (8 blocks of 16) next to the tiny target, whose pools the test fills."""
    config, target_state = package_parts["config"], package_parts["state_dict"]
    head_state = repeat_head_state(config, target_state, draft_vocab, mix=1.0, seed=5)
    embed = target_state["model.embed_tokens.weight"]
    return MtpHead(config, head_state, DecoderModel(config, target_state), embed[draft_vocab].contiguous(),
                   target_state["model.norm.weight"], num_blocks=8, block_size=16)


def test_a_row_drafting_fewer_steps_than_its_batch_mates_writes_no_slot_past_its_blocks(package_parts, draft_vocab):
    """Row A drafts one token and its new token's slot ends its only block; row B drafts three.
    The steps only B takes must not write A's next slots, which lie in a block A was not given."""
    config = package_parts["config"]
    head = pooled_head(package_parts, draft_vocab)
    generator = torch.Generator().manual_seed(4)
    head.hidden_pool.copy_(torch.randn(head.hidden_pool.shape, generator=generator))
    for pool in (*head.kv_cache.keys, *head.kv_cache.values):
        pool[:, 0].fill_(7.0)  # block 0 belongs to neither row
    tokens = torch.randint(0, config.vocab_size, (40,), generator=generator).tolist()
    a = HeadRow(0, (1,), tuple(tokens[:15]), device_tokens=1, sample_index=0, steps=1)
    b = HeadRow(0, (2, 3), tuple(tokens[:20]), device_tokens=1, sample_index=1, steps=3)
    with torch.inference_mode():
        drafts = head.run([a, b], torch.tensor([[tokens[15]], [tokens[20]]]), torch.tensor([1, 1]))
    assert drafts is not None and drafts.tokens.shape == (2, 3)
    for pool in (*head.kv_cache.keys, *head.kv_cache.values):
        assert bool((pool[:, 0] == 7.0).all())


def test_a_filtered_rows_q_is_the_heads_distribution_under_the_requests_filters(package_parts, draft_vocab):
    """q of a row with top-k, top-p or min-p is the unfiltered q restricted to the tokens those
    filters keep (the smallest most-probable set reaching top_p; p >= min_p * max p), renormalised,
    and the draft is drawn from it; a greedy batch-mate drafts its argmax with a one-hot q."""
    config = package_parts["config"]
    head = pooled_head(package_parts, draft_vocab)
    generator = torch.Generator().manual_seed(4)
    head.hidden_pool.copy_(torch.randn(head.hidden_pool.shape, generator=generator) * 4)
    tokens = torch.randint(0, config.vocab_size, (12,), generator=generator).tolist()

    def first_q(**sampling):
        row = HeadRow(0, (1,), tuple(tokens[:11]), device_tokens=1, sample_index=0, steps=1, seed=3, **sampling)
        greedy = HeadRow(0, (2,), tuple(tokens[:11]), device_tokens=1, sample_index=0, steps=1)
        with torch.inference_mode():
            drafts = head.run([row, greedy], torch.tensor([[tokens[11]]]), torch.tensor([1]))
        assert drafts is not None
        greedy_q = drafts.probs[1, 0]
        assert greedy_q.max().item() == 1.0 and greedy_q.sum().item() == 1.0
        assert draft_vocab[greedy_q.argmax()] == drafts.tokens[1, 0]
        return drafts.probs[0, 0], int(drafts.tokens[0, 0])

    unfiltered, _ = first_q(temperature=0.8)
    order = unfiltered.argsort(descending=True)
    top_p_set = order[: int((unfiltered[order].cumsum(0) < 0.6).sum()) + 1]
    for sampling, kept in (
        ({"top_k": 5}, order[:5]),
        ({"top_p": 0.6}, top_p_set),
        ({"min_p": 0.2}, (unfiltered >= 0.2 * unfiltered.max()).nonzero().squeeze(1)),
    ):
        q, draft = first_q(temperature=0.8, **sampling)
        expected = torch.zeros_like(unfiltered)
        expected[kept] = unfiltered[kept] / unfiltered[kept].sum()
        assert 1 < len(kept) < len(unfiltered), sampling
        torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-4)
        assert q[(draft_vocab == draft).nonzero().item()] > 0, sampling
