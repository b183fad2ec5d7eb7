"""Fine-tuning data: conversations packed with a loss mask, and every loss honouring it.

- Only response tokens count: changing the targets the mask leaves out changes neither the loss nor a
  gradient, for the built-in Llama and a Hugging Face Llama, with every loss kernel.
- Packed documents do not see each other: changing the first conversation of a packed sample leaves
  the second's loss and the gradients unchanged.
- The engine's loss is the mean over the counted targets of the whole step, however they fall into
  micro-batches; the noise scale's read of the first micro-batch's gradient divides by the weight
  that micro-batch's loss was given, so it is that micro-batch's own mean gradient with a mask too.
"""

import copy
import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from core.config import JobConfig
from core.errors import ConfigError, DataError
from storage import chat
from storage.flags import TOKEN_MASK, flag, unpack
from storage.prepare import prepare_dataset
from storage.shards import TokenDataset
from storage.tokenizers import ByteTokenizer
from tests.engine_support import engine_spec
from tests.hf_support import write_model
from workers.engine import Engine, loss_arguments
from workers.loop import validate
from workers.models import make_workload

SEQ = 96
TURNS = [[("user", "2+2?"), ("assistant", "4")], [("system", "be brief"), ("user", "3+3?"), ("assistant", "six")]]


def packed_sample() -> torch.Tensor:
    """Both conversations packed into one flagged sample of SEQ + 1 words."""
    words: list[np.ndarray] = []

    class Sink:
        def add(self, block):
            words.append(block)

        def flush(self):
            pass

    packer = chat.Packer(Sink(), SEQ, ByteTokenizer().eos_id)
    for turns in TURNS:
        packer.add(chat.encode(turns, ByteTokenizer()))
    packer.flush()
    return torch.from_numpy(np.concatenate(words)[:SEQ + 1].astype(np.int64))[None]


def workloads(tmp_path):
    write_model(tmp_path, "llama", vocab_size=288)
    builtin = make_workload(JobConfig.from_dict({"model": {"kind": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                                                           "n_embd": 32, "seq_len": SEQ, "vocab_size": 288}}).model)
    hf = make_workload(JobConfig.from_dict({"model": {"kind": "hf", "hf_dir": str(tmp_path), "seq_len": SEQ}}).model)
    return {"builtin": builtin, "hf": hf}


def loss_and_grads(workload, model, batch: torch.Tensor, kernel: str, targets: torch.Tensor | None = None):
    """The loss of the flagged batch (its targets replaced by `targets` when given) and every gradient."""
    model.zero_grad()
    b = unpack(batch)
    loss = workload.loss(model, b.inputs, b.targets if targets is None else targets, loss_kernel=kernel,
                         loss_mask=b.loss_mask, positions=b.positions)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-6)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_packed_sample_counts_only_the_responses():
    b = unpack(packed_sample())
    text = bytes(b.inputs[0].clamp(max=255).tolist()).decode("latin-1")
    assert text.startswith("<|user|>\n2+2?\n<|assistant|>\n4\xff<|system|>\nbe brief\n<|user|>\n3+3?\n<|assistant|>\nsix")
    counted = b.targets[0][b.loss_mask[0]].tolist()
    assert counted == [ord("4"), 256, ord("s"), ord("i"), ord("x"), 256]
    second = text.index("<|system|>")
    assert b.positions[0, second] == 0 and b.positions[0, second + 5] == 5 and b.positions[0, 3] == 3


@pytest.mark.parametrize("kernel", ["fused", "plain", "chunked"])
def test_targets_outside_the_mask_change_neither_loss_nor_gradients(tmp_path, kernel):
    batch = packed_sample()
    b = unpack(batch)
    changed = b.targets.masked_fill(~b.loss_mask, 7)  # the prompts' and the padding's targets, all others
    for name, workload in workloads(tmp_path).items():
        torch.manual_seed(0)
        model = workload.build()
        assert_same(loss_and_grads(workload, model, batch, kernel), loss_and_grads(workload, model, batch, kernel, changed))
        counted = batch | (1 << 31)  # every target counted: now the changed targets do count
        assert loss_and_grads(workload, model, counted, kernel)[0] != pytest.approx(
            loss_and_grads(workload, model, counted, kernel, changed)[0], rel=1e-4), name


def test_a_packed_conversation_does_not_see_the_one_before(tmp_path):
    batch = packed_sample()
    b = unpack(batch)
    second = int((b.positions[0] == 0).nonzero()[1])
    only_second = batch.clone()
    only_second[:, 1:second + 1] &= ~(1 << 31)  # the first conversation's response no longer counts
    changed = only_second.clone()
    changed[:, 1:second] = (changed[:, 1:second] & ~0xFF) | 9  # ...and its tokens are others
    for name, workload in workloads(tmp_path).items():
        torch.manual_seed(0)
        model = workload.build()
        assert_same(loss_and_grads(workload, model, only_second, "plain"), loss_and_grads(workload, model, changed, "plain"))


def two_micro_batch_engine(token_flags: bool = True) -> Engine:
    config = JobConfig.from_dict({"model": {"kind": "llama", "n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": SEQ},
                                  "train": {"global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-9, "min_lr": 0.0,
                                            "grad_clip": 0.0}})
    spec = engine_spec(config, 1, 1, 2)
    return Engine(dataclasses.replace(spec, data=dataclasses.replace(spec.data, token_flags=token_flags)), 0,
                  torch.device("cpu"))


def test_the_step_loss_is_the_mean_over_every_counted_target():
    engine = two_micro_batch_engine()
    first = packed_sample()
    second = first.clone()
    second[:, 1:SEQ // 2] &= ~(1 << 31)  # fewer counted targets: the micro-batches weigh differently
    loss, _ = engine([first, second], lr=1e-9)
    tokens = torch.cat([first, second])
    b = unpack(tokens)
    with torch.no_grad():
        expected = engine.workload.loss(engine.model, b.inputs, b.targets, loss_mask=b.loss_mask, positions=b.positions)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert int(unpack(first).loss_mask.sum()) != int(unpack(second).loss_mask.sum())


class ValSplit:
    """The two members of a validation loader that validate reads, every sample `sample`."""

    def __init__(self, sample: torch.Tensor, num_samples: int = 4):
        self.sample, self.dataset = sample, SimpleNamespace(num_samples=num_samples)

    def load(self, chunks):
        return [self.sample.expand(len(chunk), -1) for chunk in chunks]


def test_validation_samples_without_a_counted_token_are_a_data_error_not_a_loss_of_nan():
    engine = two_micro_batch_engine()
    with pytest.raises(DataError) as refused:
        validate(engine, ValSplit(packed_sample() & ~(1 << 31)), eval_samples=4)  # no target flagged
    assert refused.value.where == "[train] eval_samples"
    assert refused.value.what == "the 4 validation samples read hold no token the loss counts"
    assert math.isfinite(validate(engine, ValSplit(packed_sample()), eval_samples=4))


@pytest.mark.parametrize("token_flags", [True, False])
def test_the_noise_read_on_one_worker_is_the_first_micro_batch_s_own_mean_gradient(token_flags):
    engine = two_micro_batch_engine(token_flags)
    first = packed_sample()
    second = first.clone()
    second[:, 1:SEQ // 2] &= ~(1 << 31)  # fewer counted targets: a loss weight other than 1/2 for each
    if not token_flags:
        first, second = first & TOKEN_MASK, second & TOKEN_MASK
    model = copy.deepcopy(engine.model)
    tokens, masks = loss_arguments(first, token_flags)
    engine.workload.loss(model, *tokens, **masks).backward()
    expected = sum(float(p.grad.square().sum()) for p in model.parameters() if p.grad is not None)
    engine([first, second], lr=1e-9)
    small_sq, small_batch = engine.local_gradient
    assert float(small_sq) == pytest.approx(expected, rel=1e-4) and small_batch == 1


def test_prepare_chat_packs_conversations_and_refuses_a_line_without_roles(tmp_path):
    source = tmp_path / "chats"
    source.mkdir()
    lines = [json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}) for turns in TURNS * 30]
    (source / "a.jsonl").write_text("\n".join(lines) + "\n")
    summary = prepare_dataset(str(source), tmp_path / "data", source_format="chat", seq_len=SEQ, workers=1)
    train = TokenDataset(tmp_path / "data", "train", SEQ)
    assert train.manifest.token_flags and train.manifest.packed_seq_len == SEQ
    assert sum(summary.documents.values()) == 60 and train.num_samples * SEQ + 1 == train.num_tokens
    starts = unpack(torch.from_numpy(train.batch(np.arange(train.num_samples)))).positions[:, 0]
    assert (starts == 0).all()  # every sample begins a conversation
    (source / "b.jsonl").write_text(lines[0] + "\n" + json.dumps({"messages": [{"content": "hi"}]}) + "\n")
    with pytest.raises(DataError) as raised:
        prepare_dataset(str(source), tmp_path / "bad", source_format="chat", seq_len=SEQ, workers=1)
    assert "b.jsonl, byte" in raised.value.where and '"role"' in raised.value.fix
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()


def write_chats(source, conversations: list[list[tuple[str, str]]]) -> str:
    source.mkdir()
    (source / "a.jsonl").write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}) + "\n"
                                            for turns in conversations))
    return str(source)


def test_prepare_counts_conversations_cut_at_the_sample_length(tmp_path):
    long = [("user", "x" * (SEQ - 10)), ("assistant", "a long answer that does not fit")]
    summary = prepare_dataset(write_chats(tmp_path / "chats", (TURNS + [long]) * 20), tmp_path / "data",
                              source_format="chat", seq_len=SEQ, workers=1)
    assert summary.truncated == 20
    assert summary.truncation_note == "; 20 conversations cut at the sample length (what followed is not trained on)"


@pytest.mark.parametrize("conversation, cut", [
    ([("user", "hello"), ("user", "anyone?")], False),  # no assistant turn at all
    ([("user", "y" * (SEQ + 5)), ("assistant", "too late")], True),
], ids=["no-assistant", "cut-before-the-answer"])
def test_prepare_refuses_conversations_that_keep_no_token_to_train_on(tmp_path, conversation, cut):
    """Trained, they gave a loss of 0 every step and a validation loss of nan, and the run 'completed'."""
    with pytest.raises(DataError) as refused:
        prepare_dataset(write_chats(tmp_path / "chats", [conversation] * 40), tmp_path / "data",
                        source_format="chat", seq_len=SEQ, workers=1)
    assert refused.value.what.startswith("the train split has no token to train on: none of its")
    assert refused.value.what.endswith(" of them cut at --seq-len 96" if cut else "conversations kept an assistant turn")
    assert refused.value.fix.startswith("give the conversations an assistant turn")
    assert ("a larger --seq-len" in refused.value.fix) == cut
    assert not (tmp_path / "data").exists()


def test_prepare_refuses_instructions_whose_responses_were_all_cut(tmp_path):
    source = tmp_path / "pairs"
    source.mkdir()
    (source / "a.jsonl").write_text("".join(json.dumps({"prompt": "p" * (SEQ + i), "response": "late"}) + "\n"
                                            for i in range(5, 45)))  # every prompt longer than a sample
    with pytest.raises(DataError) as refused:
        prepare_dataset(str(source), tmp_path / "data", source_format="instruction", seq_len=SEQ, workers=1)
    assert " conversations kept a response, " in refused.value.what
    assert refused.value.fix.startswith("give the conversations a response, or a larger --seq-len")


def test_flags_round_trip():
    words = flag(np.array([5, 6, 7]), np.array([False, True, True]))
    b = unpack(torch.from_numpy(np.concatenate([words, flag(np.array([8]), np.array([True]))]).astype(np.int64))[None])
    assert b.inputs.tolist() == [[5, 6, 7]] and b.targets.tolist() == [[6, 7, 8]]
    assert b.loss_mask.tolist() == [[True, True, True]] and b.positions.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("kernel", ["fused", "chunked"])
def test_the_loss_kernels_leave_out_ignored_rows_as_the_plain_loss_does(kernel):
    from kernels.loss import IGNORE_INDEX, linear_cross_entropy, plain_cross_entropy
    from workers.models.chunked_loss import chunked_cross_entropy

    torch.manual_seed(0)
    hidden, weight = torch.randn(64, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (64,)).masked_fill(torch.rand(64) < 0.6, IGNORE_INDEX)
    run = {"fused": lambda: linear_cross_entropy(hidden, weight, targets),
           "chunked": lambda: chunked_cross_entropy(hidden, weight, targets, chunk_rows=16)}[kernel]
    results = []
    for loss_fn in (run, lambda: plain_cross_entropy(hidden @ weight.t(), targets)):
        hidden.grad = weight.grad = None
        loss = loss_fn()
        loss.backward()
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert results[0][1][targets == IGNORE_INDEX].abs().max() == 0  # an ignored row gets no gradient


def test_a_built_in_llama_exports_to_the_transformers_model_of_its_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from orchestrator.export import write_hf

    write_model(tmp_path / "hf", "mistral", vocab_size=288)
    config = JobConfig.from_dict({"model": {"kind": "llama", "hf_dir": str(tmp_path / "hf"), "seq_len": SEQ}})
    torch.manual_seed(3)
    model = make_workload(config.model).build()  # other weights than those in hf_dir: the trained ones
    write_hf(model, config, tmp_path / "out")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported).__name__ == "MistralForCausalLM"
    tokens = unpack(packed_sample()).inputs
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, model(tokens), rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="is not an empty directory"):
        write_hf(model, config, tmp_path / "out")


def test_shard_checks_read_the_token_ids_under_the_flags(tmp_path):
    from storage.verify import verify_dataset

    source = tmp_path / "chats"
    source.mkdir()
    lines = [json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}) for turns in TURNS * 30]
    (source / "a.jsonl").write_text("\n".join(lines) + "\n")
    prepare_dataset(str(source), tmp_path / "data", source_format="chat", seq_len=SEQ, workers=1)
    train = TokenDataset(tmp_path / "data", "train", SEQ, checksum_percent=100.0)
    words = train.batch(np.arange(train.num_samples))  # flagged words far above the vocabulary pass the checks
    assert int(words.max()) >= 1 << 31 and verify_dataset(tmp_path / "data").ok
    damaged = words[0].astype(np.uint32)
    damaged[5] = (1 << 31) | 300  # a counted target whose id is past the bytes tokenizer's 257
    with pytest.raises(DataError, match="token id 300 ≥ vocabulary size 257") as raised:
        train.check_token_ids(train.extents(np.array([0])), damaged)
    assert raised.value.where.endswith(f"offset {train.extents(np.array([0]))[0].file_offset + 5 * 4}")
    shard = tmp_path / "data" / train.shards[0].path
    payload = bytearray(shard.read_bytes())
    payload[-4:] = np.uint32((1 << 31) | 300).tobytes()
    shard.write_bytes(bytes(payload))
    assert "token id 300 ≥ vocabulary size 257" in verify_dataset(tmp_path / "data").problems[0].problem
