"""ikdflash train on a tiny target: the fork's features, a short real training run whose checkpoint
the reference loads and whose GGUF computes what the checkpoint computes, resumption, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from ikdflash import Engine, _core  # noqa: E402
from ikdflash.cli import main  # noqa: E402
from fixtures.tinydraft import write_hf_target  # noqa: E402

WORDS = ("the river town bridge water spring flood history people built argued watched each "
         "generation stone wooden old new north south market square bell tower morning evening").split()


def write_corpus(path, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = []
            for _ in range(2):
                turns.append({"from": "human", "value": " ".join(rng.choice(WORDS, 12))})
                turns.append({"from": "gpt", "value": " ".join(rng.choice(WORDS, 40))})
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return path


DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
DFLASH2_FLAGS = ["--arch", "dflash2", "--conv-kernel-size", "3", "--selector-rank", "8", "--selector-top-k", "6"]
DSPARK_FLAGS = ["--arch", "dspark", "--markov-rank", "8"]


def with_flags(argv, **values):
    """A copy of a command line with some flags' values changed (max_steps=5 sets --max-steps 5)."""
    changed = list(argv)
    for name, value in values.items():
        changed[changed.index("--" + name.replace("_", "-")) + 1] = str(value)
    return changed


def same_step(target, first, second) -> tuple[dict, dict]:
    """Two drafts' step on the same 24 context rows: the second's logits within 1e-4 of the
    first's, and the same tokens. Their info()."""
    model = _core.Model(str(target), n_ctx=256)
    drafts = [_core.Draft(model, str(path)) for path in (first, second)]
    features = np.random.default_rng(4).standard_normal((24, drafts[0].info()["n_target_features"]))
    positions = np.arange(24, dtype=np.int32)
    (logits_a, tokens_a), (logits_b, tokens_b) = (d.forward(features.astype(np.float32), positions, 65, 24)
                                                  for d in drafts)
    assert float(np.max(np.abs(logits_b - logits_a)) / np.max(np.abs(logits_a))) <= 1e-4
    assert tokens_b == tokens_a
    return drafts[0].info(), drafts[1].info()


def step_is_the_references(target, run, tmp_path):
    """The run's GGUF, stepped on 20 context rows, computes what the reference computes from its
    checkpoint (logits within 1e-4, the same proposal): (model, features, logits, tokens)."""
    from reference import ReferenceDraft

    reference = ReferenceDraft(run / "draft-hf", write_hf_target(tmp_path / "target-hf", target))
    model = _core.Model(str(target), n_ctx=256)
    draft = _core.Draft(model, str(run / "draft.gguf"))
    features = np.random.default_rng(3).standard_normal((20, draft.info()["n_target_features"])).astype(np.float32)
    logits, tokens = draft.forward(features, np.arange(20, dtype=np.int32), 65, 20)
    ref = reference.logits(features, 65, 20)
    assert float(np.max(np.abs(logits - ref)) / np.max(np.abs(ref))) <= 1e-4
    assert tokens == reference.proposal(features, 65, 20)
    return model, features, logits, tokens


def from_trained_draft(run, argv, out, **values):
    """The trained run's command, one step at a learning rate of ~0 in OUT, starting from its draft."""
    return with_flags(argv, out=out, max_steps=1, lr="1e-12", **values) + [
        "--data", str(run / "data"), "--init", str(run / "draft.gguf"), "--eval-prompts", "0"]


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """One short training run: (run folder, command line)."""
    folder = tmp_path_factory.mktemp("train")
    corpus = write_corpus(folder / "chats.jsonl", 60)
    argv = ["train", "--target", str(target), "--out", str(folder / "run"), "--corpus", str(corpus),
            "--minutes", "5", "--max-steps", "60", "--data-rows", "3000", "--seq-len", "256", "--window", "8",
            "--layers", "2", "--head-vocab", "0", "--outtype", "f32", "--lr", "3e-3",
            "--eval-prompts", "3", "--eval-tokens", "24", "--threads", "2", "--system", "Be brief."]
    assert main(argv) == 0
    return folder / "run", argv


def test_the_corpus_is_decoded_as_it_is_read_and_a_cut_off_tail_ends_it(tmp_path, monkeypatch):
    """Records across the reader's chunks decode whole; a JSON list cut part-way (as the packaged
    ShareGPT file is) ends at its last complete record; JSONL reads the same."""
    from ikdflash.train import corpus

    write_corpus(tmp_path / "chats.jsonl", 6)
    records = [json.loads(line) for line in (tmp_path / "chats.jsonl").read_text().splitlines()]
    listed = json.dumps(records, indent=1)
    (tmp_path / "cut.json").write_text(listed[: listed.index(records[-1]["id"])])
    monkeypatch.setattr(corpus, "CHUNK", 37)
    ids = [c.id for c in corpus.read_conversations(tmp_path / "cut.json")]
    assert ids == [r["id"] for r in records[:-1]]
    assert [c.messages for c in corpus.read_conversations(tmp_path / "chats.jsonl")][1:3] == \
        [c.messages for c in corpus.read_conversations(tmp_path / "cut.json")][1:3]
    with pytest.raises(corpus.CorpusError, match="corpus file not found"):
        next(corpus.read_conversations(tmp_path / "nope.json"))


def test_layer_features_are_the_targets_own(target):
    model = _core.Model(str(target), n_ctx=256, n_batch=16)
    prompt = model.tokenize("the river town and its bridges", add_special=True)
    continuation = model.generate_greedy(prompt, 12, stop_at_eog=False)
    tokens = prompt + continuation
    features, greedy = _core.training.layer_features(model, tokens, [0, 2])
    assert features.shape == (len(tokens), 2 * model.n_embd) and features.dtype == np.float32
    # the greedy token after each prompt position is what greedy decoding produced
    assert list(greedy[len(prompt) - 1:-1]) == continuation
    # rows do not depend on how the sequence was cut into batches (n_batch 16 here, 256 below)
    whole = _core.Model(str(target), n_ctx=256, n_batch=256)
    np.testing.assert_allclose(_core.training.layer_features(whole, tokens, [0, 2])[0], features, rtol=1e-4, atol=1e-4)
    # no layers: nothing captured (the capture's cost is measured against this), same greedy tokens
    bare, bare_greedy = _core.training.layer_features(model, tokens, [])
    assert bare.shape == (len(tokens), 0) and list(bare_greedy) == list(greedy)
    # the top tokens: the greedy one first, logits less the largest, falling
    same, same_greedy, top_ids, top_logits = _core.training.layer_features(model, tokens, [0, 2], top_k=5)
    np.testing.assert_array_equal(same, features)
    assert top_ids.shape == top_logits.shape == (len(tokens), 5)
    assert list(top_ids[:, 0]) == list(greedy) and (top_logits[:, 0] == 0).all()
    assert (np.diff(top_logits, axis=1) <= 0).all() and all(len(set(row)) == 5 for row in top_ids)
    with pytest.raises(ValueError, match="top_k must lie in"):
        _core.training.layer_features(model, tokens, [0], top_k=-1)
    with pytest.raises(ValueError, match="outside 0..2"):
        _core.training.layer_features(model, tokens, [3])
    with pytest.raises(ValueError, match="do not fit the context"):
        _core.training.layer_features(model, tokens * 20, [0])


def test_captured_rows_are_the_reference_hidden_states(tiny_model, tmp_path):
    """The captured layer outputs are transformers' hidden states of the same target, in one pass
    of the whole prompt: a capture that left a layer's memory to later nodes of the graph (the
    compute buffers' plan ignored the capture) read other layers' values here. With a CUDA build
    the target runs on the GPU too, where fused kernels must still write the tapped outputs."""
    import torch
    from transformers import Qwen3ForCausalLM

    target = tiny_model("qwen3")
    reference = Qwen3ForCausalLM.from_pretrained(write_hf_target(tmp_path / "hf", target, full=True),
                                                 dtype=torch.float32).eval()
    tokens = [(17 * i) % 200 + 5 for i in range(40)]
    with torch.no_grad():
        out = reference(torch.tensor([tokens]), output_hidden_states=True)
    hidden = out.hidden_states
    for gpu_layers in (0, 99) if "CUDA" in _core.build_info()["backends"] else (0,):
        model = _core.Model(str(target), n_ctx=512, n_batch=512, n_gpu_layers=gpu_layers)
        features, _, top_ids, top_logits = _core.training.layer_features(model, tokens, [0, 2], top_k=8)
        for k, il in enumerate([0, 2]):
            np.testing.assert_allclose(features[:, k * model.n_embd:(k + 1) * model.n_embd],
                                       hidden[il + 1][0].numpy(), rtol=1e-2, atol=1e-2)
        # the soft labels: the reference's logits at the kept ids, less its largest
        logits = out.logits[0].numpy()
        relative = logits - logits.max(1, keepdims=True)
        np.testing.assert_allclose(top_logits, np.take_along_axis(relative, top_ids, 1), atol=2e-2)
        np.testing.assert_allclose(top_logits, -np.sort(-relative, 1)[:, :8], atol=2e-2)
        model.close()


@pytest.mark.parametrize("layout,dflash2", [("last-full", None), ("all-sliding", None), ("last-full", DFLASH2)],
                         ids=["last-full", "all-sliding", "last-full-dflash2"])
def test_the_training_forward_is_the_reference_block_by_block(target, tmp_path, layout, dflash2):
    """Many blocks of one sequence in one training pass compute what the reference computes for
    each block alone, with the context rows before its anchor (anchors past the window, so the
    sliding layers' mask is exercised); a DFlash2 draft's convolutions stay within each block, and
    its selector, fed the reference's greedy choices as predecessors, makes those choices."""
    import torch

    from ikdflash.sources.hf import read_tensors
    from ikdflash.train.draft import DraftConfig, DraftModel, layer_types, save_checkpoint
    from reference import ReferenceDraft

    hf_target = write_hf_target(tmp_path / "target-hf", target)
    weights = read_tensors(hf_target)
    config = json.loads((hf_target / "config.json").read_text())
    n_embd = config["hidden_size"]
    cfg = DraftConfig(hidden_size=n_embd, vocab_size=config["vocab_size"],
                      num_target_layers=config["num_hidden_layers"],
                      target_layer_ids=[0, 1], layer_types=layer_types(2, layout), sliding_window=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, block_size=5,
                      mask_token_id=65, rope_theta=10000.0, dflash2=dflash2)
    torch.manual_seed(0)
    draft = DraftModel(cfg, weights["model.embed_tokens.weight"], weights["lm_head.weight"])
    for p in draft.parameters():  # weights large enough that every term shows in the logits
        p.data.normal_(0.0, 0.3)
    reference = ReferenceDraft(save_checkpoint(draft, tmp_path / "draft"), hf_target)
    features = torch.randn(1, 24, 2 * n_embd)
    anchors = torch.tensor([[3, 9, 17]])
    first = [70, 71, 72]
    block = torch.full((1, 3, 5), 65)
    block[0, :, 0] = torch.tensor(first)
    with torch.no_grad():
        hidden = draft.hidden(features, block, anchors)[0]
        logits = (hidden @ draft.head.T).numpy()
    for i, a in enumerate(anchors[0].tolist()):
        ref = reference.logits(features[0, :a].numpy(), first[i], a)
        np.testing.assert_allclose(logits[5 * i:5 * i + 5], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        if dflash2:
            proposal = reference.proposal(features[0, :a].numpy(), first[i], a)
            rows = slice(5 * i + 1, 5 * i + 5)
            with torch.no_grad():
                candidates = torch.topk(torch.from_numpy(logits[rows]), dflash2["selector_top_k"]).indices
                scores = torch.from_numpy(logits[rows]).gather(-1, candidates) + draft.candidate_selector.pair_scores(
                    hidden[rows], torch.tensor([first[i]] + proposal[:-1]), candidates)
            assert candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0].tolist() == proposal


def test_target_layers_keep_their_attention_scores_under_neox_rope():
    """A llama GGUF orders Q/K rows for ggml's interleaved RoPE; the draft rotates NeoX halves.
    After unpermute_llama_qk, every query-key score is the one the target computes."""
    from ikdflash.train.draft import unpermute_llama_qk

    rng = np.random.default_rng(0)
    n_head, head_dim, d, theta = 3, 8, 12, 10000.0
    wq, wk = rng.standard_normal((n_head * head_dim, d)), rng.standard_normal((n_head * head_dim, d))
    x, y = rng.standard_normal(d), rng.standard_normal(d)
    freq = theta ** (-np.arange(head_dim // 2) / (head_dim // 2))

    def interleaved(v, pos):
        v = v.reshape(n_head, head_dim // 2, 2)
        c, s = np.cos(pos * freq), np.sin(pos * freq)
        return np.stack([v[..., 0] * c - v[..., 1] * s, v[..., 1] * c + v[..., 0] * s], -1).reshape(n_head, -1)

    def neox(v, pos):
        v = v.reshape(n_head, 2, head_dim // 2)
        c, s = np.cos(pos * freq), np.sin(pos * freq)
        return np.concatenate([v[:, 0] * c - v[:, 1] * s, v[:, 1] * c + v[:, 0] * s], -1)

    ours = (neox(unpermute_llama_qk(wq, n_head) @ x, 7) * neox(unpermute_llama_qk(wk, n_head) @ y, 3)).sum(-1)
    theirs = (interleaved(wq @ x, 7) * interleaved(wk @ y, 3)).sum(-1)
    np.testing.assert_allclose(ours, theirs, rtol=1e-10)


def test_labels_follow_the_targets_path(tmp_path):
    """Block position j's label is the target's greedy token after row a+j-1; on the target's own
    path it weighs 1, past the first place the text leaves it, off_path_weight."""
    from ikdflash.train.data import Dataset
    from ikdflash.train.loop import Batches, TrainSettings

    tokens = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    greedy = np.array([6, 7, 0, 9, 10, 11, 12, 13, 14, 15])  # the text leaves the target's path at row 3
    data = Dataset(folder=tmp_path, meta={"n_rows": 10, "width": 1}, index=np.array([[0, 10]]), tokens=tokens,
                   greedy=greedy, trainable=np.ones(10, dtype=np.uint8), features=np.zeros((10, 1), np.float16))
    label_map = np.arange(32)
    target = Batches([data], 5, 31, TrainSettings(minutes=1, off_path_weight=0.25), label_map)
    labels, weight, on_path, _ = target.labels(tokens, greedy, 1)
    assert list(labels) == [7, 0, 9, 10]          # greedy[1..4]
    assert list(weight) == [1.0, 1.0, 0.25, 0.25]  # row 3 holds 8, the target said 0 after row 2
    assert list(on_path) == [True, True, False, False]
    assert list(target.labels(tokens, greedy, 8)[1]) == [1.0, 1.0, 0.0, 0.0]  # the sequence ends
    corpus = Batches([data], 5, 31, TrainSettings(minutes=1, labels="corpus"), label_map)
    assert list(corpus.labels(tokens, greedy, 1)[0]) == [7, 8, 9, 10]


def test_soft_labels_are_the_targets_top_tokens_after_each_row(tmp_path):
    """Block position j of anchor a learns the distribution the data kept after row a+j-1, over
    the top tokens the cut head holds (renormalised); a folder without top tokens is refused."""
    import torch

    from ikdflash.train.data import Dataset
    from ikdflash.train.loop import Batches, TrainSettings, step_loss

    n, k = 12, 3
    top_ids = np.stack([np.arange(n) + 1, np.arange(n) + 2, np.full(n, 30)], 1).astype(np.int32)
    top_logits = np.tile(np.array([0.0, -1.0, -2.0], np.float16), (n, 1))
    data = Dataset(folder=tmp_path, meta={"n_rows": n, "width": 1, "top_k": k}, index=np.array([[0, n]]),
                   tokens=np.arange(n), greedy=np.arange(n) + 1, trainable=np.ones(n, dtype=np.uint8),
                   features=np.zeros((n, 1), np.float16), top_ids=top_ids, top_logits=top_logits)
    label_map = np.arange(32)
    label_map[30] = -1  # id 30 is not in the head: dropped, the others renormalised
    settings = TrainSettings(minutes=1, soft_labels=0.5, sequences_per_step=2, anchors_per_sequence=12)
    batch = Batches([data], 4, 31, settings, label_map).sample(np.random.default_rng(0))
    anchors = batch["anchors"][0]
    assert (anchors == -1).any()  # 10 anchor rows for 12 anchors: unused ones learn nothing
    for i, a in enumerate(anchors.tolist()):
        for j in range(1, 4):
            if a < 0 or a + j - 1 >= n:
                assert batch["soft_probs"][0, i, j - 1].sum() == 0
            else:
                assert batch["soft_ids"][0, i, j - 1, :2].tolist() == [a + j, a + j + 1]
                np.testing.assert_allclose(batch["soft_probs"][0, i, j - 1], [1 / (1 + np.exp(-1)),
                                           np.exp(-1) / (1 + np.exp(-1)), 0], rtol=1e-3)
    # with the whole loss on the distribution, a head that scores it exactly has its entropy as loss
    settings_b = TrainSettings(minutes=1)
    assert settings_b.soft_labels == 0 and "soft_ids" not in Batches([data], 4, 31, settings_b, label_map).sample(
        np.random.default_rng(0))

    class Exact(torch.nn.Module):  # hidden state = the wanted log-probabilities, head = identity
        cfg = type("cfg", (), {"block_size": 4})
        candidate_selector = markov_head = confidence_head = None  # a DFlash1 draft

        def hidden(self, features, block, anchors):
            S, A = anchors.shape
            out = torch.full((S, A, 4, 32), -1e4)
            out[:, :, 1:].scatter_(-1, batch["soft_ids"][..., :2], batch["soft_probs"][..., :2].clamp(min=1e-9).log())
            return out.view(S * A * 4, 32)

    loss, _ = step_loss(Exact(), batch, torch.eye(32), torch.ones(3), 3, soft_labels=1.0)
    p = 1 / (1 + np.exp(-1))
    assert loss.item() == pytest.approx(-(p * np.log(p) + (1 - p) * np.log(1 - p)), rel=1e-3)
    old = Dataset(folder=tmp_path / "old", meta={"n_rows": n, "width": 1}, index=np.array([[0, n]]),
                  tokens=np.arange(n), greedy=np.arange(n) + 1, trainable=np.ones(n, dtype=np.uint8),
                  features=np.zeros((n, 1), np.float16))
    with pytest.raises(ValueError, match="old: made before data kept the target's top tokens"):
        Batches([data, old], 4, 31, settings, label_map)
    with pytest.raises(ValueError, match="--soft-labels must lie in 0..1"):
        TrainSettings(minutes=1, soft_labels=1.5)


def test_data_share_sets_where_anchors_come_from(tmp_path):
    from ikdflash.train.data import Dataset
    from ikdflash.train.loop import Batches, TrainSettings

    def folder(n_seq: int) -> Dataset:
        n = 10 * n_seq
        return Dataset(folder=tmp_path, meta={"n_rows": n, "width": 1},
                       index=np.array([[10 * i, 10] for i in range(n_seq)]), tokens=np.arange(n), greedy=np.arange(n),
                       trainable=np.ones(n, dtype=np.uint8), features=np.zeros((n, 1), np.float16))

    small, large = folder(1), folder(9)
    by_size = Batches([small, large], 4, 0, TrainSettings(minutes=1), np.arange(100))
    assert by_size.p[0] == 0.1
    shared = Batches([small, large], 4, 0, TrainSettings(minutes=1, first_share=0.5), np.arange(100))
    assert shared.p[0] == 0.5 and np.isclose(shared.p[1:].sum(), 0.5)


def test_training_lowers_the_loss_and_measures_acceptance(trained):
    run, _ = trained
    report = json.loads((run / "report.json").read_text())
    history = report["history"]
    assert history[0][0] == 1 and history[-1][0] == 60
    assert history[-1][2] < 0.8 * history[0][2]
    held_out = report["held_out"]
    assert held_out["steps"] > 0 and len(held_out["per_position"]) == 4
    assert report["config"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert json.loads((run.parent / "run" / "data" / "meta.json").read_text())["system"] == "Be brief."


def test_the_reference_loads_the_checkpoint_and_the_gguf_computes_the_same(trained, target, tmp_path):
    run, _ = trained
    step_is_the_references(target, run, tmp_path)


def test_a_second_run_resumes(trained):
    run, argv = trained
    assert main(with_flags(argv, max_steps=5) + ["--eval-prompts", "0"]) == 0
    history = json.loads((run / "report.json").read_text())["history"]
    assert history[-1][0] == 65
    stages = json.loads((run / "stages.json").read_text())
    assert [s["to_step"] for s in stages] == [60, 65]
    assert stages[1]["command"].startswith("ikdflash train --target") and "--max-steps 5" in stages[1]["command"]


def test_a_new_run_goes_on_from_a_trained_draft(trained, tmp_path, capsys):
    """--init DRAFT.gguf: a fresh run folder starts from the draft's weights (a learning rate of
    ~0 keeps them, so its export equals the draft it started from); a draft of another shape or
    layout is refused by name, one of another window starts it."""
    import gguf

    run, argv = trained
    out = tmp_path / "again"
    again = from_trained_draft(run, argv, out)
    assert main(again) == 0
    before = {t.name: np.array(t.data) for t in gguf.GGUFReader(run / "draft.gguf").tensors}
    after = {t.name: np.array(t.data) for t in gguf.GGUFReader(out / "draft.gguf").tensors}
    assert before.keys() == after.keys() and len(before) > 10
    for name, value in before.items():
        assert np.allclose(after[name], value, rtol=0, atol=1e-6), name
    first_loss = json.loads((run / "report.json").read_text())["history"][0][2]
    assert json.loads((out / "report.json").read_text())["history"][0][2] < 0.9 * first_loss

    assert main(with_flags(again, out=tmp_path / "wider", window=16)) == 0
    assert main(with_flags(again, out=tmp_path / "all-sliding") + ["--layout", "all-sliding"]) == 2
    assert "sliding layers [True, False], but this run's draft has [True, True]" in capsys.readouterr().err
    assert main(with_flags(again, out=tmp_path / "missing", init=tmp_path / "nothing.gguf")) == 2
    assert "nothing.gguf" in capsys.readouterr().err


def test_a_run_going_on_from_a_draft_keeps_its_heads_cut(trained, target, tmp_path):
    """--init DRAFT whose head scores N ids, with --head-vocab N: the new run's draft scores DRAFT's
    ids, not the ones its data uses most; another --head-vocab cuts the head anew from the data."""
    import gguf

    def head_ids(folder):
        return json.loads((folder / "draft-hf" / "config.json").read_text())["dflash_config"]["head_token_ids"]

    run, argv = trained
    assert main(from_trained_draft(run, argv, tmp_path / "cut", head_vocab=40)) == 0
    from_data = head_ids(tmp_path / "cut")
    # the same draft scoring the 40 highest ids instead, which the data uses least
    n_vocab = _core.Model(str(target), n_ctx=64).n_vocab
    ours = list(range(n_vocab - 40, n_vocab))
    assert len(from_data) == 40 and from_data != ours
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes((tmp_path / "cut" / "draft.gguf").read_bytes())
    field = gguf.GGUFReader(crafted, "r+").fields["dflash-draft.dflash.head_token_ids"]
    for part, value in zip(field.data, ours):
        field.parts[part][0] = value

    kept = with_flags(from_trained_draft(run, argv, tmp_path / "kept", head_vocab=40), init=crafted)
    assert main(kept) == 0
    assert head_ids(tmp_path / "kept") == ours
    assert main(with_flags(kept, out=tmp_path / "recut", head_vocab=30)) == 0
    assert head_ids(tmp_path / "recut") == sorted(set(head_ids(tmp_path / "recut"))) != ours[:30]
    assert set(head_ids(tmp_path / "recut")) < set(from_data)


def test_a_draft_grows_a_layer_and_starts_out_computing_what_it_did(trained, target, tmp_path, capsys):
    """--init DRAFT with more --layers than DRAFT has: its layers become the top ones and the new one
    below passes its input through, so the fork's 3-layer export (a learning rate of ~0) gives the
    2-layer draft's logits; a draft with more layers than --layers is refused by name."""
    run, argv = trained
    grown = from_trained_draft(run, argv, tmp_path / "grown", layers=3)
    assert main(grown) == 0
    small, big = same_step(target, run / "draft.gguf", tmp_path / "grown" / "draft.gguf")
    assert (small["n_layer"], big["n_layer"]) == (2, 3)

    assert main(with_flags(grown, out=tmp_path / "shrunk", layers=1)) == 2
    assert "2 layers, more than this run's draft has (1)" in capsys.readouterr().err


def test_a_dflash1_draft_grows_into_dflash2_proposing_what_it_did(trained, target, tmp_path):
    """--arch dflash2 --init DFLASH1.gguf: the convolutions start as the identity and the
    selector's successor codebook at 0, so the fork's DFlash2 export (a learning rate of ~0)
    computes the DFlash1 draft's logits and proposes its tokens."""
    run, argv = trained
    assert main(from_trained_draft(run, argv, tmp_path / "grown") + DFLASH2_FLAGS) == 0
    one, two = same_step(target, run / "draft.gguf", tmp_path / "grown" / "draft.gguf")
    assert (one["format"], two["format"]) == ("dflash-draft", "dflash")
    assert two["dflash2"] == DFLASH2


def test_a_dflash1_draft_grows_into_dspark_proposing_what_it_did(trained, target, tmp_path):
    """--arch dspark --init DFLASH1.gguf: the Markov head's W2 starts at 0, so the fork's DSpark
    export (SpecForge's layout, rows 1.. proposing) computes the DFlash1 draft's logits and
    proposes its tokens; its confidence head starts at 1/2."""
    run, argv = trained
    assert main(from_trained_draft(run, argv, tmp_path / "grown") + DSPARK_FLAGS) == 0
    one, two = same_step(target, run / "draft.gguf", tmp_path / "grown" / "draft.gguf")
    assert one["dspark"] is None
    assert two["dspark"] == {"markov_rank": 8, "confidence_width": 64 + 8, "anchor_first": 0, "window_from_block": 0}


def test_a_dspark_run_trains_its_heads_and_speculates_losslessly(trained, target, tmp_path, capsys):
    """A DSpark run from the DFlash1 draft lowers its loss; its GGUF starts a further run (its
    heads read back); the fork speculates with it exactly as the target alone, its confidence
    head's output steering by conf_min, and the trained head tells its rows apart."""
    run, argv = trained
    out = tmp_path / "dspark"
    assert main(with_flags(from_trained_draft(run, argv, out), max_steps=30, lr="3e-3") + DSPARK_FLAGS) == 0
    history = json.loads((out / "report.json").read_text())["history"]
    assert history[-1][2] < history[0][2]
    again = tmp_path / "again"
    assert main(with_flags(from_trained_draft(run, argv, again), init=out / "draft.gguf") + DSPARK_FLAGS) == 0
    same_step(target, out / "draft.gguf", again / "draft.gguf")
    model = _core.Model(str(target), n_ctx=256)
    draft = _core.Draft(model, str(out / "draft.gguf"))
    cache = _core.CrossContext(draft, 64)
    features = np.random.default_rng(5).standard_normal((24, draft.info()["n_target_features"])).astype(np.float32)
    cache.append(features, np.arange(24, dtype=np.int32))
    _, confidence = cache.propose_with_confidence(65, 24, draft.info()["max_proposal"])
    assert np.std(confidence) > 1e-3 and all(0 < c < 1 for c in confidence)
    del cache, draft
    model.close()
    with Engine(target, out / "draft.gguf", n_ctx=512) as engine:
        plain = engine.generate("the quick brown fox", max_tokens=32)
        for options in (dict(confidence=True), dict(adaptive=False, conf_min=0.5)):
            assert engine.speculate("the quick brown fox", max_tokens=32, n_max=4, **options).tokens == plain.tokens


def test_a_dflash2_run_trains_its_selector_and_the_fork_computes_the_reference(trained, target, tmp_path, capsys):
    """A DFlash2 run from the DFlash1 draft lowers its loss; the reference loads its checkpoint and
    the fork's export computes its logits and chooses its tokens; its GGUF starts a further run
    (the flat layout read back), while a DFlash2 draft cannot start a DFlash1 run or one of other
    settings."""
    run, argv = trained
    out = tmp_path / "dflash2"
    command = with_flags(from_trained_draft(run, argv, out), max_steps=20, lr="3e-3") + DFLASH2_FLAGS
    assert main(command) == 0
    history = json.loads((out / "report.json").read_text())["history"]
    assert history[-1][2] < history[0][2]
    model, features, logits, tokens = step_is_the_references(target, out, tmp_path)

    again = with_flags(command, out=tmp_path / "again", init=out / "draft.gguf", max_steps=1, lr="1e-12")
    assert main(again) == 0
    again_logits, again_tokens = _core.Draft(model, str(tmp_path / "again" / "draft.gguf")).forward(
        features, np.arange(20, dtype=np.int32), 65, 20)
    assert float(np.max(np.abs(again_logits - logits)) / np.max(np.abs(logits))) <= 1e-4
    assert again_tokens == tokens
    assert main(with_flags(again, out=tmp_path / "as-dflash1", arch="dflash")) == 2
    assert "DFlash2 settings" in capsys.readouterr().err
    assert main(with_flags(again, out=tmp_path / "other-rank", selector_rank=4)) == 2
    assert "DFlash2 settings" in capsys.readouterr().err


def test_a_draft_starts_a_run_that_reads_more_target_layers(trained, target, tmp_path, capsys):
    """data refresh --target-layers captures other layers for the same tokens; --init DRAFT with
    --target-layers naming more layers than DRAFT reads: the new layers' features start with weight
    0, so the fork's export (a learning rate of ~0) gives DRAFT's logits whatever those features
    are; a draft reading a layer the run does not is refused by name."""
    from ikdflash.train.data import main as data_main
    from ikdflash.train.data import open_dataset

    run, argv = trained
    theirs = open_dataset(run / "data").meta["layer_ids"]
    ours = sorted(set(theirs) | {0, 2})
    more = tmp_path / "more-layers"
    assert data_main(["refresh", "--target", str(target), str(run / "data"), str(more),
                      "--target-layers", *map(str, ours)]) == 0
    assert open_dataset(more).meta["layer_ids"] == ours
    wider = with_flags(from_trained_draft(run, argv, tmp_path / "wider"), data=more) + [
        "--target-layers", ",".join(map(str, ours))]
    assert main(wider) == 0
    model = _core.Model(str(target), n_ctx=256)
    small, big = (_core.Draft(model, str(folder / "draft.gguf")) for folder in (run, tmp_path / "wider"))
    rng = np.random.default_rng(5)
    n = model.n_embd
    assert big.info()["n_target_features"] == len(ours) * n
    features = rng.standard_normal((24, len(ours) * n)).astype(np.float32)
    theirs_only = np.concatenate([features[:, ours.index(il) * n:(ours.index(il) + 1) * n] for il in theirs], axis=1)
    positions = np.arange(24, dtype=np.int32)
    small_logits, small_tokens = small.forward(theirs_only, positions, 65, 24)
    big_logits, big_tokens = big.forward(features, positions, 65, 24)
    assert float(np.max(np.abs(big_logits - small_logits)) / np.max(np.abs(small_logits))) <= 1e-4
    assert big_tokens == small_tokens

    assert theirs == [1]  # the tiny run's default
    other = tmp_path / "other-layers"
    assert data_main(["refresh", "--target", str(target), str(run / "data"), str(other), "--target-layers", "0", "2"]) == 0
    capsys.readouterr()
    narrow = with_flags(from_trained_draft(run, argv, tmp_path / "narrow"), data=other) + ["--target-layers", "0,2"]
    assert main(narrow) == 2
    assert "target layer ids [1], but this run's draft has [0, 2]" in capsys.readouterr().err


def test_answers_beside_the_corpus_with_a_cut_head_and_one_schedule(target, tmp_path):
    """--kind generated with --corpus-rows: the target's own answers (decoded side by side) and
    corpus rows in one run; the head cut to the ids the data uses most is exported, so the fork's
    draft scores exactly those; --total-minutes bounds every run of the folder together."""
    corpus = write_corpus(tmp_path / "chats.jsonl", 40)
    out = tmp_path / "run"
    argv = ["train", "--target", str(target), "--out", str(out), "--corpus", str(corpus), "--kind", "generated",
            "--data-rows", "1500", "--corpus-rows", "1500", "--data-share", "0.7", "--seq-len", "256",
            "--window", "8", "--block-size", "5", "--layout", "all-sliding", "--head-vocab", "100",
            "--total-minutes", "0.02", "--minutes", "5", "--outtype", "f32", "--eval-prompts", "2",
            "--eval-tokens", "16", "--threads", "2", "--gamma", "1.5", "--soft-labels", "0.5"]
    assert main(argv) == 0
    answers = json.loads((out / "data" / "meta.json").read_text())
    assert answers["kind"] == "generated" and answers["n_rows"] >= 1500 and answers["top_k"] == 16
    assert json.loads((out / "data-corpus" / "meta.json").read_text())["n_rows"] >= 1500
    ids = json.loads((out / "draft-hf" / "config.json").read_text())["dflash_config"]["head_token_ids"]
    assert len(ids) == 100 and ids == sorted(ids)
    model = _core.Model(str(target), n_ctx=256)
    draft = _core.Draft(model, str(out / "draft.gguf"))
    assert draft.info()["n_head_tokens"] == 100 and draft.info()["block_size"] == 5
    _, tokens = draft.forward(np.zeros((4, draft.info()["n_target_features"]), np.float32),
                              np.arange(4, dtype=np.int32), 65, 4)
    assert set(tokens) <= set(ids)
    # the schedule is spent: the same command again resumes and trains no further step
    stage = json.loads((out / "stages.json").read_text())[-1]
    assert stage["gamma"] == 1.5 and stage["soft_labels"] == 0.5
    steps = stage["to_step"]
    assert main(argv) == 0
    assert json.loads((out / "stages.json").read_text())[-1]["to_step"] == steps


def test_refresh_recomputes_features_for_the_same_tokens_and_resumes(trained, target, tmp_path, capsys):
    """Features made by an earlier fork (here: zeroed, labels wiped) come back as the target
    computes them now, for the same tokens; a refresh stopped halfway goes on where it stopped."""
    import shutil

    from ikdflash.train.data import main as data_main
    from ikdflash.train.data import open_dataset

    run, _ = trained
    good = open_dataset(run / "data")
    stale = tmp_path / "stale"
    shutil.copytree(run / "data", stale)
    np.memmap(stale / "features.f16", dtype=np.float16, mode="r+")[:] = 0
    np.memmap(stale / "greedy.i32", dtype=np.int32, mode="r+")[:] = -1
    fresh = tmp_path / "fresh"
    assert data_main(["refresh", "--target", str(target), str(stale), str(fresh)]) == 0
    half = json.loads((fresh / "meta.json").read_text())
    half_sequences = half["n_sequences"] // 2
    half["n_rows"] = int(good.index[half_sequences][0])
    half["n_sequences"] = half_sequences
    (fresh / "meta.json").write_text(json.dumps(half))
    assert data_main(["refresh", "--target", str(target), str(stale), str(fresh)]) == 0
    again = open_dataset(fresh)
    assert again.meta["n_sequences"] == good.meta["n_sequences"] and again.meta["refreshed_from"] == str(stale)
    for name in ("index", "tokens", "trainable", "greedy", "top_ids"):
        assert np.array_equal(getattr(again, name), getattr(good, name)), name
    assert np.abs(again.features.astype(np.float32) - good.features.astype(np.float32)).max() < 1e-2
    assert data_main(["refresh", "--target", str(target), str(fresh), str(fresh)]) == 2
    assert "not the one it reads" in capsys.readouterr().err
    # the tokens alone (what a repository keeps) give the same folder back
    assert data_main(["tokens", str(stale), str(tmp_path / "tokens.npz")]) == 0
    assert data_main(["refresh", "--target", str(target), str(tmp_path / "tokens.npz"), str(tmp_path / "back")]) == 0
    back = open_dataset(tmp_path / "back")
    for name in ("index", "tokens", "trainable", "greedy", "features"):
        assert np.array_equal(getattr(back, name), getattr(again, name)), name
    (tmp_path / "junk.npz").write_bytes(b"junk")
    assert data_main(["refresh", "--target", str(target), str(tmp_path / "junk.npz"), str(tmp_path / "x")]) == 2
    assert "neither a data folder nor a tokens file" in capsys.readouterr().err


@pytest.mark.parametrize("arch,weights", [("llama", "F32"), ("qwen3", "F32"), ("llama", "Q4_1")])
def test_the_torch_capture_is_the_forks(tiny_model, arch, weights):
    """The target in PyTorch captures what the fork does: features within the fork's rounding of
    activations (to 8 bits for quantized weights), the same greedy tokens and top logits; sequences
    side by side in one padded pass give what each gives alone."""
    from ikdflash.train.torch_target import TorchTarget

    target = tiny_model(arch, weight_type=weights)
    rng = np.random.default_rng(3)
    sequences = [rng.integers(0, 200, 37).tolist(), rng.integers(0, 200, 12).tolist()]
    model = _core.Model(str(target), n_ctx=256, n_batch=256)
    fork = [_core.training.layer_features(model, s, [0, 2], top_k=8) for s in sequences]
    model.close()
    with TorchTarget(target, "cpu") as ours:
        both = ours.capture(sequences, [0, 2], 8)
        alone = [ours.capture([s], [0, 2], 8)[0] for s in sequences]
        assert len(ours.capture(sequences, [1], 0)[0]) == 2  # features and greedy only
        with pytest.raises(ValueError, match="layer ids must lie in 0..3"):
            ours.capture(sequences, [4], 8)
    tolerance = 2e-3 if weights == "F32" else 5e-2
    for (f_feat, f_greedy, f_ids, f_logits), got, single in zip(fork, both, alone):
        feat, greedy, ids, logits = got
        assert feat.shape == f_feat.shape and ids.shape == logits.shape == f_ids.shape
        assert np.abs(feat - f_feat).max() <= tolerance * np.abs(f_feat).max()
        assert (greedy == f_greedy).mean() >= (1.0 if weights == "F32" else 0.9)
        assert (logits[:, 0] == 0).all() and (np.diff(logits, axis=1) <= 0).all()
        np.testing.assert_allclose(logits, f_logits, atol=20 * tolerance)  # the same falling logits
        for a, b in zip(got, single):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_refresh_with_the_torch_capture_trains_the_same_draft(trained, target, tmp_path, tiny_model, capsys):
    """data refresh --capture torch makes the folder the fork's refresh makes (same tokens, labels,
    features within rounding), and a run trains on it; a target PyTorch does not run is refused."""
    from ikdflash.train.data import main as data_main
    from ikdflash.train.data import open_dataset

    run, argv = trained
    good = open_dataset(run / "data")
    ours = tmp_path / "torch"
    assert data_main(["refresh", "--target", str(target), "--capture", "torch", str(run / "data"), str(ours)]) == 0
    got = open_dataset(ours)
    for name in ("index", "tokens", "trainable"):
        assert np.array_equal(getattr(got, name), getattr(good, name)), name
    assert (np.asarray(got.greedy) == np.asarray(good.greedy)).mean() >= 0.99
    assert np.abs(got.features.astype(np.float32) - good.features.astype(np.float32)).max() < 1e-2
    step = with_flags(from_trained_draft(run, argv, tmp_path / "on-torch"), data=ours)
    assert main(step) == 0
    capsys.readouterr()
    hybrid = tiny_model("qwen35moe")
    assert data_main(["refresh", "--target", str(hybrid), "--capture", "torch", str(run / "data"),
                      str(tmp_path / "no")]) == 2
    assert "a qwen35moe target; the PyTorch capture runs llama and qwen3 targets" in capsys.readouterr().err


def test_a_machine_without_the_fork_built_captures_and_trains(trained, tmp_path):
    """What a GPU machine without the fork runs before any build: the capture in PyTorch, then a training run
    (python -m ikdflash.cli.train, no held-out measure), with the compiled fork unimportable."""
    import subprocess
    import sys

    run, argv = trained
    blocked = ("import runpy, sys; sys.modules['ikdflash._core'] = None; module = sys.argv.pop(1); "
               "runpy.run_module(module, run_name='__main__', alter_sys=True)")
    captured = tmp_path / "captured"
    target = argv[argv.index("--target") + 1]
    steps = [["ikdflash.train.data", "refresh", "--target", target, "--capture", "torch", str(run / "data"),
              str(captured)],
             ["ikdflash.cli.train", *with_flags(from_trained_draft(run, argv, tmp_path / "run"), data=captured)[1:]]]
    for step in steps:
        done = subprocess.run([sys.executable, "-c", blocked, *step], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "draft.gguf").stat().st_size > 0
    # the block is real: the command line tool itself needs the fork
    done = subprocess.run([sys.executable, "-c", blocked, "ikdflash.cli", "--version"], capture_output=True, text=True)
    assert done.returncode != 0 and "ikdflash._core" in done.stderr


def test_prompts_answered_in_pytorch_are_the_targets_answers(trained, target, tmp_path, capsys):
    """data prompts keeps the first user turns after those a folder answered, as the fork renders
    them; data answer decodes them in PyTorch (greedy ones: what the fork's own decoding answers),
    captures them, and goes on from where it stopped."""
    from ikdflash.train.corpus import training_conversations
    from ikdflash.train.data import main as data_main
    from ikdflash.train.data import open_dataset, open_tokens
    from ikdflash.train.torch_target import TorchTarget

    run, argv = trained
    corpus = argv[argv.index("--corpus") + 1]
    prompts = tmp_path / "prompts.npz"
    assert data_main(["prompts", "--target", str(target), "--corpus", corpus, "--after", str(run / "data"),
                      "--count", "10", "--system", "Be brief.", str(prompts)]) == 0
    asked = open_tokens(prompts)
    first = open_dataset(run / "data").meta["conversations_done"]
    assert asked.meta["conversations_first"] == first and asked.meta["n_sequences"] == 10
    turns = [c.first_user_turn for c in training_conversations(corpus)][first:first + 10]
    from ikdflash import Model

    model = Model(target, n_ctx=2048)
    for (start, n), turn in zip(asked.index, turns):
        assert turn.encode() in model.detokenize(asked.tokens[start:start + n].tolist())
    folder = tmp_path / "answers"
    assert data_main(["answer", "--target", str(target), "--rows", "1", str(prompts), str(folder)]) == 0
    assert open_dataset(folder).meta["conversations_done"] == TorchTarget(target, "cpu").answers_per_call == 8
    assert data_main(["answer", "--target", str(target), "--answer-tokens", "256", str(prompts), str(folder)]) == 0
    got = open_dataset(folder)
    assert got.meta["conversations_done"] == 10 and got.meta["n_sequences"] == 10  # every answer kept, none twice
    questions = [asked.tokens[s:s + n].tolist() for s, n in asked.index]
    for i, ((start, n), question) in enumerate(zip(got.index, questions)):
        tokens, trainable = got.tokens[start:start + n].tolist(), got.trainable[start:start + n].tolist()
        assert tokens[:len(question)] == question and trainable == [0] * len(question) + [1] * (n - len(question))
        if i % 4 != 3:  # greedy (every fourth is sampled at 0.8): each token the greedy one after the last,
            # as PyTorch captured it and (within the fork's rounding: random tiny weights tie often) as the fork does
            assert tokens[len(question):] == got.greedy[start + len(question) - 1:start + n - 1].tolist()
            fork = _core.training.layer_features(model._native, tokens, [0], 0)[1]
            assert (fork[len(question) - 1:-1] == tokens[len(question):]).mean() >= 0.9
    assert data_main(["answer", "--target", str(target), str(run / "data"), str(tmp_path / "x")]) == 2
    assert "not a prompts file" in capsys.readouterr().err


def test_refresh_of_some_sequences(trained, target, tmp_path, capsys):
    """--sequences FIRST:LAST refreshes only those sequences (the same rows a whole refresh
    gives them); a folder resumes only the part it was started with."""
    from ikdflash.train.data import main as data_main
    from ikdflash.train.data import open_dataset

    run, _ = trained
    good = open_dataset(run / "data")
    n = good.meta["n_sequences"]
    assert n >= 3
    part = tmp_path / "part"
    assert data_main(["refresh", "--target", str(target), "--sequences", f"1:{n - 1}", str(run / "data"), str(part)]) == 0
    got = open_dataset(part)
    rows = slice(int(good.index[1][0]), int(good.index[n - 1][0]))
    assert got.meta["n_sequences"] == n - 2 and got.n_rows == rows.stop - rows.start
    assert got.meta["refreshed_sequences"] == [1, n - 1]
    for name in ("tokens", "trainable", "greedy", "top_ids"):
        assert np.array_equal(getattr(got, name), getattr(good, name)[rows]), name
    assert np.abs(got.features.astype(np.float32) - good.features[rows].astype(np.float32)).max() < 1e-2
    for other in (["--sequences", "1:"], []):  # another part, or all of it
        assert data_main(["refresh", "--target", str(target), *other, str(run / "data"), str(part)]) == 2
        assert "refreshed_sequences" in capsys.readouterr().err
    assert data_main(["refresh", "--target", str(target), "--sequences", f"{n}:", str(run / "data"),
                      str(tmp_path / "none")]) == 2
    assert "none of those --sequences asks for" in capsys.readouterr().err
    for bad in ("x:", "1:2:3", "-1:"):
        with pytest.raises(SystemExit):
            data_main(["refresh", "--target", str(target), "--sequences", bad, str(run / "data"), str(tmp_path / "y")])
        assert "--sequences" in capsys.readouterr().err


def test_a_retrain_starts_from_saved_answers_and_answers_only_new_prompts(target, tmp_path, capsys):
    """train --answers: the answers a repository keeps as token ids (`data tokens`) start the data
    folder, their features computed again by the fork, and the folder then grows with answers to
    the conversations after them; the same command again resumes without redoing either."""
    from ikdflash.train.data import main as data_main
    from ikdflash.train.data import open_dataset

    corpus = write_corpus(tmp_path / "chats.jsonl", 40)
    common = ["--target", str(target), "--corpus", str(corpus), "--kind", "generated", "--seq-len", "256",
              "--system", "Be brief.", "--threads", "2"]
    assert data_main(["build", *common, "--rows", "600", str(tmp_path / "earlier")]) == 0
    earlier = open_dataset(tmp_path / "earlier")
    assert data_main(["tokens", str(tmp_path / "earlier"), str(tmp_path / "answers.npz")]) == 0
    out = tmp_path / "run"
    argv = ["train", *common, "--out", str(out), "--answers", str(tmp_path / "answers.npz"), "--data-rows", "1200",
            "--window", "8", "--block-size", "5", "--head-vocab", "0", "--max-steps", "2", "--outtype", "f32",
            "--eval-prompts", "0"]
    assert main(argv) == 0
    grown = open_dataset(out / "data")
    n = earlier.meta["n_sequences"]
    assert grown.n_rows >= 1200 and grown.meta["n_sequences"] > n
    for name in ("tokens", "trainable", "greedy"):
        assert np.array_equal(getattr(grown, name)[:earlier.n_rows], getattr(earlier, name)), name
    assert np.abs(grown.features[:earlier.n_rows].astype(np.float32) - earlier.features.astype(np.float32)).max() < 1e-2
    seeded = {tuple(grown.tokens[first:first + length]) for first, length in grown.index[:n]}
    assert not seeded & {tuple(grown.tokens[first:first + length]) for first, length in grown.index[n:]}
    assert main(argv) == 0  # resumes: nothing refreshed or answered again
    assert open_dataset(out / "data").meta["n_sequences"] == grown.meta["n_sequences"]
    capsys.readouterr()
    assert main([*argv, "--kind", "corpus"]) == 2
    assert "--answers starts --kind generated data" in capsys.readouterr().err
    assert main([*argv, "--answers", str(tmp_path / "missing.npz")]) == 2
    assert "missing.npz: no such file" in capsys.readouterr().err


def test_data_build_makes_what_train_makes_and_grows_a_folder(trained, target, tmp_path, capsys):
    """`data build` with train's data arguments makes the folder the training run made (same
    sequences, same features); asked for more rows it appends to it; bad layers are refused."""
    import shutil

    from ikdflash.train.data import main as data_main
    from ikdflash.train.data import open_dataset

    run, argv = trained
    made = open_dataset(run / "data")
    common = ["build", "--target", str(target), "--corpus", str(run.parent / "chats.jsonl"), "--seq-len", "256",
              "--system", "Be brief.", "--threads", "2"]
    folder = tmp_path / "data"
    assert data_main([*common, "--rows", str(made.n_rows), str(folder)]) == 0
    built = open_dataset(folder)
    assert built.meta["layer_ids"] == made.meta["layer_ids"]
    for name in ("index", "tokens", "trainable", "greedy", "features"):
        assert np.array_equal(getattr(built, name), getattr(made, name)), name
    for name in ("top_ids", "top_logits"):
        assert built.top_k == 16 and np.array_equal(getattr(built, name), getattr(made, name)), name
    # a folder made before rows kept top tokens still serves as it is, but does not grow
    older = tmp_path / "older"
    shutil.copytree(folder, older)
    meta = json.loads((older / "meta.json").read_text())
    del meta["top_k"]
    (older / "meta.json").write_text(json.dumps(meta))
    for name in ("top_ids.i32", "top_logits.f16"):
        (older / name).unlink()
    assert data_main([*common, "--rows", str(made.n_rows), str(older)]) == 0
    assert open_dataset(older).top_ids is None
    assert data_main([*common, "--rows", str(made.n_rows + 500), str(older)]) == 2
    assert "keeps no top tokens a row, so its rows cannot grow with 16; refresh it" in capsys.readouterr().err
    assert data_main([*common, "--rows", str(made.n_rows + 500), str(folder)]) == 0
    grown = open_dataset(folder)
    assert grown.n_rows >= made.n_rows + 500
    assert np.array_equal(grown.tokens[:made.n_rows], made.tokens)
    assert grown.top_ids.shape == (grown.n_rows, 16)
    assert data_main([*common, "--rows", "10", str(tmp_path / "bad"), "--target-layers", "0", "99"]) == 2
    assert "--target-layers must lie in" in capsys.readouterr().err


def test_bad_input_is_refused(trained, target, tmp_path, capsys):
    run, argv = trained
    base = ["train", "--target", str(target), "--threads", "2"]

    assert main(base + ["--out", str(tmp_path / "a"), "--minutes", "0"]) == 2
    assert "--minutes must be positive" in capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path / "g"), "--gamma", "0"]) == 2
    assert "--gamma must be positive" in capsys.readouterr().err

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(base + ["--out", str(tmp_path / "b"), "--corpus", str(empty)]) == 2
    assert "no conversation with a user turn" in capsys.readouterr().err

    # the run folder's data was made for another target
    other = tmp_path / "other.gguf"
    from fixtures.tinymodels import write_tiny_model
    write_tiny_model(other, arch="llama", n_embd=32, n_head=2, n_head_kv=1)
    assert main(with_flags(argv, target=other)) == 2
    assert "holds data made with" in capsys.readouterr().err

    corrupt = tmp_path / "c"
    (corrupt).mkdir()
    import shutil
    shutil.copytree(run / "data", corrupt / "data")
    (corrupt / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert main(with_flags(argv, out=corrupt)) == 2
    assert "checkpoint.pt" in capsys.readouterr().err
