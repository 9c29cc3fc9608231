"""factory.paired: two evaluations scored only on the videos both drew (same prompt index, caption and seed)."""

import json

from factory import paired as pr


def _video(prompt, caption, seed, count, colour, shape, motion):
    return {
        "prompt": prompt,
        "caption": caption,
        "seed": seed,
        "held_out": False,
        "count": count,
        "colour": colour,
        "shape": shape,
        "motion": motion,
    }


def _eval(videos_by_variant):
    return {"variants": {v: {"per_video": vs} for v, vs in videos_by_variant.items()}}


def test_only_shared_videos_are_scored_and_a_repeated_caption_counts_twice(tmp_path, capsys):
    a = _eval(
        {
            "flash": [
                _video(0, "a red square moves up", 0, True, True, True, True),
                _video(0, "a red square moves up", 1, False, False, False, False),  # seed 1: not in b
                _video(1, "a blue circle stays still", 0, True, True, False, None),
                _video(2, "a red square moves up", 0, False, True, True, True),  # the same caption, prompt 2
            ],
            "linear": [_video(0, "a red square moves up", 0, True, True, True, True)],  # not in b: left out
        }
    )
    b = _eval(
        {
            "flash": [
                _video(0, "a red square moves up", 0, False, True, False, False),
                _video(1, "a blue circle stays still", 0, True, False, True, None),
                _video(2, "a red square moves up", 0, True, True, True, True),
                _video(3, "a green diamond moves left", 0, True, True, True, True),  # not in a
            ]
        }
    )
    got = pr.paired(a, b)
    assert list(got) == ["flash"]
    sa, sb = got["flash"]
    # a on prompts 0, 1, 2 (seed 0): count 2/3, colour 3/3, shape 2/3, motion 2/2 (prompt 1 names none);
    # overall: prompts 0 only (1 has shape wrong, 2 count wrong) -> 1/3
    assert (sa["videos"], sa["count"], sa["colour"], sa["shape"], sa["motion"]) == (3, 2 / 3, 1.0, 2 / 3, 1.0)
    assert sa["overall"] == 1 / 3
    # b on the same three: count 2/3, colour 2/3, shape 2/3, motion 1/2, overall prompt 2 only -> 1/3
    assert (sb["videos"], sb["count"], sb["colour"], sb["shape"], sb["motion"]) == (3, 2 / 3, 2 / 3, 2 / 3, 0.5)
    assert sb["overall"] == 1 / 3

    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    assert pr.main([str(fa), str(fb), "--labels", "new", "old"]) == 0
    table = capsys.readouterr().out
    assert "| softmax (FA) | 3 | 0.67 / 1.00 / 0.67 / 1.00, 0.33 | 0.67 / 0.67 / 0.67 / 0.50, 0.33 |" in table
    assert "| new | old |" in table and "linear" not in table


def test_evaluations_that_share_nothing_are_refused(tmp_path, capsys):
    a = _eval({"flash": [_video(0, "a red square moves up", 0, True, True, True, True)]})
    b = _eval({"flash": [_video(0, "a red square moves up", 1, True, True, True, True)]})  # another seed
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    assert pr.main([str(fa), str(fb)]) == 2
    assert "share no video" in capsys.readouterr().err
    assert pr.main([str(fa), str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
