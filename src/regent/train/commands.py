"""`regent data prepare SRC DST` (text or hf:NAME to pre-tokenized shards) and `regent data verify DST`.

Shards are what `--train.data DST` reads at any corpus size (`regent.train.shards`). Errors are one line on
stderr and exit code 2; a killed `prepare` is resumed by running the same command again.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("data", help="prepare and check pre-tokenized training data",
                                   description="Tokenize a corpus once into memory-mapped shards for "
                                               "`regent train --train.data DST`, or check shards.")
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    prep = sub.add_parser(
        "prepare", help="tokenize text files (or hf:NAME[:split]) into a shard directory",
        description="Tokenize SRC into DST: token files and a manifest. Streaming (bounded memory), atomic (the "
                    "manifest is written last), resumable (a killed run resumes when run again).")
    prep.add_argument("src", metavar="SRC", help="a text file, a directory (every file under it, sorted), a quoted "
                                                 "glob, or hf:NAME[:split] (needs the datasets package)")
    prep.add_argument("dst", metavar="DST", help="the shard directory to write (new, empty, or a half-written one "
                                                 "to resume)")
    prep.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json (default: the byte "
                                                        "tokenizer); train with the same --train.tokenizer")
    from regent.train.shards import DEFAULT_FILE_TOKENS

    prep.add_argument("--file-tokens", type=int, default=DEFAULT_FILE_TOKENS,
                      help=f"tokens per output file, about (default {DEFAULT_FILE_TOKENS:,}); a killed run "
                           "resumes after the last whole file")
    prep.add_argument("--force", action="store_true", help="replace what DST holds and start over")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar (it is off without a terminal)")
    prep.set_defaults(func=_prepare)
    ver = sub.add_parser("verify", help="check every byte of a shard directory against its manifest",
                         description="Hash every shard file and compare with the manifest (trainers check sizes "
                                     "and both ends of each file only).")
    ver.add_argument("dst", metavar="DST")
    ver.add_argument("--tokenizer", default=None, help="also check the shards were made by this tokenizer.json")
    ver.set_defaults(func=_verify)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
    return parser


def _fail(message: str) -> int:
    print(f"regent data: error: {message}", file=sys.stderr)
    return 2


def _prepare(args: argparse.Namespace) -> int:
    from regent.train.data import build_tokenizer
    from regent.train.shards import ShardError, prepare_shards

    start = time.perf_counter()
    try:
        tokenizer = build_tokenizer(args.tokenizer)
        manifest = prepare_shards(args.src, args.dst, tokenizer, tokenizer_path=args.tokenizer,
                                  file_tokens=args.file_tokens, force=args.force,
                                  progress=False if args.no_progress else None)
    except (ShardError, ValueError, OSError) as exc:
        return _fail(str(exc))
    elapsed = time.perf_counter() - start
    if manifest.get("already_prepared"):
        print(f"{args.dst} already holds these shards ({manifest['num_tokens']:,} tokens); nothing to do")
        return 0
    print(f"wrote {manifest['num_tokens']:,} tokens ({manifest['dtype']}, vocab {manifest['vocab_size']}) from "
          f"{manifest['num_documents']:,} documents in {len(manifest['files'])} file(s) to {args.dst} in "
          f"{elapsed:.1f} s; train with --train.data {args.dst}"
          + (f" --train.tokenizer {args.tokenizer}" if args.tokenizer else ""))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from regent.train.data import build_tokenizer
    from regent.train.shards import ShardError, ShardSet

    try:
        shards = ShardSet(args.dst)
        if args.tokenizer is not None:
            shards.check_tokenizer(build_tokenizer(args.tokenizer), option="--tokenizer")
        shards.verify(full=True)
    except (ShardError, ValueError, OSError) as exc:
        return _fail(str(exc))
    print(f"{args.dst}: {len(shards.files)} file(s), {shards.num_tokens:,} tokens, every checksum matches")
    return 0
