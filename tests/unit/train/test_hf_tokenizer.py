"""Optional Hugging Face tokenizer path: a BPE trained in the test (no download) drives the debug model."""

from __future__ import annotations

import pytest
import torch

from regent.train.config import TrainConfig
from regent.train.data import HFTokenizer, builtin_corpus_files

tokenizers = pytest.importorskip("tokenizers")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|begin_of_text|>", "<|end_of_text|>"])
    files = [str(f) for f in builtin_corpus_files()[:20]]
    tok.train(files, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_hf_tokenizer_encodes_and_sizes_the_model(tokenizer_file):
    from regent.train.trainer import Trainer

    hf = HFTokenizer(tokenizer_file)
    assert hf.eos_id == 2 and hf.bos_id == 1
    ids = hf.encode(b"def main():\n    return 0\n")
    assert ids.dtype.kind == "i" and 0 < len(ids) < 25  # merges make it shorter than the bytes
    trainer = Trainer(TrainConfig(tokenizer=tokenizer_file, seq_len=32, batch_size=2, data_max_bytes=200_000))
    assert trainer.model_args.vocab_size == 64 * -(-hf.vocab_size // 64)
    assert trainer.train_step()["loss"] > 0


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        HFTokenizer(str(tmp_path / "nope.json"))
