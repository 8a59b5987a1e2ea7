"""Recipes: every shipped TOML loads; unknown keys and bad values fail naming the key."""

from pathlib import Path

import pytest

from minirl.config import recipe
from minirl.config import recipes as R
from minirl.errors import UsageError

SHIPPED = sorted(R.RECIPES_DIR.glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_recipe_loads(path):
    rec = R.load(path)
    assert rec.loss.eps_low == 0.2 and rec.loss.eps_high == 0.27 and rec.loss.tis_cap == 5.0


def test_defaults_follow_the_paper():
    rec = recipe.Recipe()
    assert (rec.loss.name, rec.loss.length_norm, rec.loss.adv_std, rec.train.minibatches) == ("minirl", False, False, 1)


def test_overrides_take_precedence_and_are_typed(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text("[train]\nlr = 1e-3\nsteps = 10\n")
    rec = R.load(p, ["train.lr=5e-4", "loss.length_norm=true", "reward.params={\"tol\": 0.1}"])
    assert rec.train.lr == 5e-4 and rec.train.steps == 10
    assert rec.loss.length_norm is True and rec.reward.params == {"tol": 0.1}


@pytest.mark.parametrize(
    "toml, sets, message",
    [
        ("[train]\nlrr = 1\n", [], "unknown recipe key train.lrr"),
        ("[trian]\nlr = 1\n", [], "unknown recipe section [trian]"),
        ("[train]\nsteps = 'ten'\n", [], "train.steps: expected int"),
        ("[train]\nsteps = 1.5\n", [], "train.steps: expected int"),
        ("", ["train.steps=abc"], "train.steps: expected int"),
        ("", ["loss.length_norm=maybe"], "loss.length_norm: expected bool"),
        ("", ["train.lr"], "--set expects section.key=value"),
        ("", ["loss.name=ppo"], "loss.name = 'ppo'; choose one of minirl, grpo, cispo"),
        ("", ["train.prompts_per_step=30", "train.minibatches=4"], "train.minibatches (4) equal mini-batches"),
        ("[train\n", [], "malformed recipe"),
    ],
)
def test_bad_recipes_fail_with_the_key(tmp_path, toml, sets, message):
    p = tmp_path / "r.toml"
    p.write_text(toml)
    with pytest.raises(UsageError) as e:
        R.load(p, sets)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_toml_round_trip(tmp_path):
    rec = R.load(R.shipped("tiny"), ["train.steps=7", "reward.params={\"a\": 1}"])
    p = tmp_path / "out.toml"
    p.write_text(rec.to_toml())
    assert R.load(p).to_dict() == rec.to_dict()


def test_missing_recipe_file():
    with pytest.raises(UsageError, match="recipe not found"):
        R.load(Path("/nonexistent/minirl.toml"))


def test_turning_is_correction_off_must_be_explicit():
    from minirl.config import recipes
    from minirl.errors import UsageError

    with pytest.raises(UsageError, match="loss.allow_uncorrected = true"):
        recipes.load(None, ["loss.is_mode=off"])
    assert recipes.load(None, ["loss.is_mode=off", "loss.allow_uncorrected=true"]).loss.is_mode == "off"
    with pytest.raises(UsageError, match=r'rollout.fp8 was replaced by rollout.precision = "fp32" \| "bf16" \| "fp8"'):
        recipes.load(None, ["rollout.fp8=true"])


def test_a_recipe_built_in_code_checks_its_fields_too():
    """#65: the ranges sit with the fields, so a Recipe built without a file is checked where it is built."""
    with pytest.raises(UsageError, match=r"train.lr = -1.0; it must be > 0"):
        recipe.Recipe(train=recipe.TrainConfig(lr=-1.0))
    with pytest.raises(UsageError, match="loss.name = 'ppo'; choose one of minirl, grpo, cispo"):
        recipe.Recipe(loss=recipe.LossConfig(name="ppo"))


def test_an_old_recipe_with_overlap_names_its_replacement(tmp_path):
    """#66: rollout.overlap became rollout.max_staleness; a recipe written before says so in one line."""
    p = tmp_path / "old.toml"
    p.write_text("[rollout]\noverlap = true\n")
    with pytest.raises(UsageError, match=r"rollout.overlap was replaced by rollout.max_staleness \(overlap = true → "
                                         r"max_staleness = 1"):
        R.load(p)
