"""DVC stage `draft_vocab`: rank the target's tokens by their count over the regenerated train answers
(data/draft_vocab/ranking.safetensors); a variant with `draft.vocab_size: N` drafts over the first N.
The coverage of each size in params `draft_vocab.report_sizes` is printed and written to
reports/draft_vocab.json."""

from pathlib import Path

import typer

from dspark_core.draft.vocab import run_draft_vocab_stage
from dspark_core.errors import run_stage


def main(params: Path = typer.Option(Path("params.yaml"), help="params file")) -> None:
    stats = run_draft_vocab_stage(params)
    print(f"draft_vocab: {stats['answer_tokens']:,} answer tokens, {stats['distinct_tokens']:,} distinct of "
          f"{stats['target_vocab_size']:,}")
    for row in stats["coverage"]:
        print(f"draft_vocab: the {row['vocab_size']:,} most frequent tokens cover {row['coverage']:.2%}")


if __name__ == "__main__":
    run_stage(main)  # a user error: one line on stderr, exit status 2
