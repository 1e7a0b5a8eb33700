"""The torchshard command line."""

from __future__ import annotations

import json

from torchshard import FlatLayout
from torchshard._cli import main


def test_layout_prints_every_parameter(capsys):
    assert main(["layout", "gpt:gpt_small"]) == 0
    out = capsys.readouterr().out
    assert "wte.weight" in out and "(also lm_head.weight)" in out
    assert "52 parameters, 842,496 elements" in out


def test_layout_json_round_trips(capsys):
    assert main(["layout", "gpt:gpt_small", "--json"]) == 0
    layout = FlatLayout.from_json(capsys.readouterr().out)
    assert layout.numel == 842_496 and json.loads(layout.to_json())["format"] == 1


def test_bad_factory_is_one_line_and_exit_2(capsys):
    assert main(["layout", "no_such_module:make"]) == 2
    assert main(["layout", "torch.nn:Linear"]) == 2
    assert main(["layout", "gpt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("torchshard: error: ") for line in err)
    assert "'module:callable'" in err[2]
