"""Draw the stored sample of JSONSchemaBench from a checkout of its repository.

    git clone https://github.com/guidance-ai/jsonschemabench /tmp/jsonschemabench
    python tests/data/jsonschemabench/sample.py /tmp/jsonschemabench

The sample is stratified by subset and drawn by the sha256 of each file's name, so
it is fixed by the source and not chosen by what any backend supports. Writes
``schemas.jsonl.gz``: one ``{"id", "subset", "schema"}`` object per line.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path

#: Schemas drawn from each subset (256 in all), roughly by each subset's share of the
#: benchmark, with at least a dozen from the small ones.
PER_SUBSET = {
    "Glaiveai2K": 30,
    "Github_trivial": 25,
    "Github_easy": 35,
    "Github_medium": 35,
    "Github_hard": 30,
    "Github_ultra": 12,
    "JsonSchemaStore": 25,
    "Kubernetes": 25,
    "Snowplow": 25,
    "WashingtonPost": 14,
}


def draw(root: Path) -> list[dict]:
    rows = []
    for subset, count in PER_SUBSET.items():
        files = sorted((root / "data" / subset).glob("*.json"), key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
        for path in files[:count]:
            rows.append({"id": f"{subset}/{path.stem}", "subset": subset, "schema": json.loads(path.read_text())})
    return rows


def main() -> None:
    rows = draw(Path(sys.argv[1]))
    out = Path(__file__).with_name("schemas.jsonl.gz")
    with gzip.GzipFile(out, "wb", mtime=0) as f:
        for row in rows:
            f.write((json.dumps(row, separators=(",", ":"), sort_keys=True) + "\n").encode())
    print(f"{len(rows)} schemas -> {out}")


if __name__ == "__main__":
    main()
