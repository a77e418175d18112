"""Write the spec's JSON Schema: `python -m lmc.schema.export [PATH]` (default: the committed copy).

A test checks that the committed lmc/schema/spec.schema.json is current.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lmc.schema.spec import Spec

SCHEMA_PATH = Path(__file__).with_name("spec.schema.json")


def spec_json_schema() -> str:
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "lmc deployment spec (v1)"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lmc.schema.export", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=SCHEMA_PATH,
                        help="where to write it (default: the committed lmc/schema/spec.schema.json)")
    target = parser.parse_args(argv).path
    target.write_text(spec_json_schema(), encoding="utf-8")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
