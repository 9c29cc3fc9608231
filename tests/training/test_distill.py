"""Output distillation (``distill.teacher``): the trained transformer's prediction also matches a frozen teacher's
on the same noisy input, timestep and caption. The loss against a formula written here, the teacher seeing exactly
the student's inputs in a real run, and a bad teacher refused before any training."""

import pytest
import torch

from tests.training.test_training import finetune, metrics
from training.config import FlowSection, load_config
from training.finetune import Distillation, ModelCall
from training.flow import FlowMatching


class Affine(torch.nn.Module):
    """A stand-in transformer with Wan's call signature: ``a * x + b * t + text.mean()`` per sample."""

    def __init__(self, a: float, b: float):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.tensor(a)), torch.nn.Parameter(torch.tensor(b))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        t = timestep.float().view(-1, *[1] * (hidden_states.dim() - 1))
        text = encoder_hidden_states.float().mean(dim=(1, 2)).view_as(t)
        return (self.a * hidden_states + self.b * t / 1000 + text,)


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_the_loss_and_its_gradient_against_the_formula(weight):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 2, 3, 5, generator=g)
    latents = torch.randn(3, 4, 2, 3, 5, generator=g)
    velocity = torch.randn(3, 4, 2, 3, 5, generator=g)
    t = torch.rand(3, generator=g) * 1000
    text = torch.randn(3, 6, 8, generator=g)
    teacher = Affine(0.7, -0.4).requires_grad_(False)
    student = Affine(1.3, 0.2)
    flow = FlowMatching(FlowSection())
    distill = Distillation(teacher, weight, ModelCall(), flow)

    pred = student(hidden_states=x, timestep=t, encoder_hidden_states=text)[0]
    loss, match = distill(pred, x, t, text, velocity, latents)
    loss.backward()

    # the formula, written out: the teacher's output by hand, plain means of squares
    tt = (t / 1000).view(3, 1, 1, 1, 1)
    target = 0.7 * x - 0.4 * tt + text.mean(dim=(1, 2)).view(3, 1, 1, 1, 1)
    a = torch.tensor(1.3, requires_grad=True)
    b = torch.tensor(0.2, requires_grad=True)
    p = a * x + b * tt + text.mean(dim=(1, 2)).view(3, 1, 1, 1, 1)
    want_match = ((p - target) ** 2).mean()
    want = (1 - weight) * ((p - velocity) ** 2).mean() + weight * want_match
    want.backward()
    torch.testing.assert_close(match, want_match.detach())
    torch.testing.assert_close(loss.detach(), want.detach())
    torch.testing.assert_close(student.a.grad, a.grad)
    torch.testing.assert_close(student.b.grad, b.grad)
    assert teacher.a.grad is None and teacher.b.grad is None  # frozen: nothing flows into it


def test_the_object_weighting_applies_to_the_teacher_term():
    g = torch.Generator().manual_seed(3)
    latents = torch.zeros(1, 2, 1, 4, 4)
    latents[..., 1, 1] = 5.0  # one object cell on a flat background
    x = torch.randn(1, 2, 1, 4, 4, generator=g)
    t = torch.tensor([500.0])
    text = torch.zeros(1, 2, 3)
    flow = FlowMatching(FlowSection(object_weight=9.0, object_threshold=1.0))
    teacher = Affine(0.0, 0.0).requires_grad_(False)  # predicts zeros
    distill = Distillation(teacher, 1.0, ModelCall(), flow)
    pred = torch.zeros(1, 2, 1, 4, 4)
    pred[..., 1, 1] = 1.0  # wrong only at the object: weight 10 of a total 10 + 15
    _, match = distill(pred, x, t, text, torch.zeros_like(pred), latents)
    torch.testing.assert_close(match, torch.tensor(2 * 10.0 / (25.0 * 2)))


def _save_tiny_teacher(folder, seed=2, **overrides):
    from pipelines import save_transformer
    from pipelines.tiny import build_tiny_transformer

    save_transformer(build_tiny_transformer(seed=seed, **overrides), folder)
    return folder


@pytest.mark.slow
def test_a_teacher_equal_to_the_start_matches_it_exactly_and_a_converted_student_learns_it(tmp_path):
    # the tiny run's transformer is build_tiny_transformer(seed=2): saved as the teacher, a softmax student starts
    # on it, so its first step's prediction matches the teacher's bit for bit only if the teacher saw the same
    # noisy input, timestep and (dropped or kept) caption as the student
    teacher = _save_tiny_teacher(tmp_path / "teacher")
    run = tmp_path / "flash"
    finetune(
        run,
        "model.variant=flash",
        "train.steps=1",
        f"distill.teacher={teacher}",
        "checkpoint.every=0",
        "data.image_ratio=1.0",  # the stills' own forward: its teacher must see the stills' inputs too
    )
    first = [r for r in metrics(run) if r.get("stage") == "train"][0]
    assert first["distill_loss"] == pytest.approx(0.0, abs=1e-12)
    assert first["image_loss"] == pytest.approx(0.0, abs=1e-12)
    assert first["loss"] == pytest.approx(0.0, abs=1e-12)  # weight 1: the loss is the teacher term alone

    run = tmp_path / "mhla"  # the tiny config converts every layer to MHLA: far from the teacher at first
    finetune(run, "train.steps=12", f"distill.teacher={teacher}", "checkpoint.every=0")
    rows = [r for r in metrics(run) if r.get("stage") == "train"]
    assert rows[0]["distill_loss"] > 1e-4
    assert sum(r["distill_loss"] for r in rows[-3:]) < sum(r["distill_loss"] for r in rows[:3])


@pytest.mark.slow
def test_a_teacher_that_is_not_the_students_kind_is_refused_before_training(tmp_path):
    from pipelines import convert_self_attention, save_transformer
    from pipelines.tiny import build_tiny_transformer

    converted = tmp_path / "converted"
    save_transformer(convert_self_attention(build_tiny_transformer(seed=2, num_layers=30), "mhla"), converted)
    proc = finetune(tmp_path / "a", "train.steps=1", f"distill.teacher={converted}", check=False)
    assert proc.returncode != 0
    assert "distill.teacher=" in proc.stderr + proc.stdout and "softmax (flash)" in proc.stderr + proc.stdout
    assert not (tmp_path / "a" / "checkpoints").exists()

    other = _save_tiny_teacher(tmp_path / "other", out_channels=8)
    proc = finetune(tmp_path / "b", "train.steps=1", f"distill.teacher={other}", check=False)
    assert proc.returncode != 0
    assert "its out_channels is 8" in proc.stderr + proc.stdout


def test_config_names_a_missing_teacher(tmp_path):
    from tests.training.test_training import TINY

    with pytest.raises(ValueError, match=r"distill.teacher='.*nowhere': expected a transformer folder"):
        load_config(TINY, [f"distill.teacher={tmp_path / 'nowhere'}"])
    with pytest.raises(ValueError, match="distill.weight"):
        load_config(TINY, ["distill.weight=1.5"])
    cfg = load_config(TINY, [])
    assert cfg.distill.teacher is None and cfg.distill.weight == 1.0
