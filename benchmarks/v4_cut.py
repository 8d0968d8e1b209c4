"""A config folder of DeepSeek V4-Flash's 32-expert cut with its first LAYERS layers (the
layer kinds in the model's order, the MTP layer's ratio kept), for ``--load-format dummy``
on a card the 43 layers' 78 GiB do not fit (an 80 GB H100: 20 layers take ~37 GiB). Each
layer's kernels and launches are the full model's; the step's time is about LAYERS / 43 of
it. Prints the folder, to pass as ``--model-path`` or ``bench step --models``:

    python3 benchmarks/v4_cut.py 20 /tmp/v4-20
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from breakgraph.models.sources import CONFIG_DIR


def main(layers: int, out: Path) -> None:
    config = json.loads((CONFIG_DIR / "deepseek-v4-flash-e32.json").read_text())
    ratios = config["compress_ratios"]
    nextn = config["num_nextn_predict_layers"]
    assert 0 < layers <= config["num_hidden_layers"]
    config["compress_ratios"] = ratios[:layers] + ratios[len(ratios) - nextn :]
    config["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    print(out)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
