"""The evaluation command line (the logic is :mod:`verl_ext.eval.run`):

    python -m recipe.gepo.evaluate model_path=/path/to/hf_or.gguf \\
        benchmarks=[amc23,aime24,aime25,math500] samples_per_problem=8 output_dir=outputs/eval/run1

``model_path`` may also be a training run's directory (either engine): its latest checkpoint is
evaluated, exported first to ``RUN_DIR/hf/step_<N>`` if no export of it exists (:mod:`.export`).

Settings: ``config/evaluate.yaml`` beside this file, mirrored by
:class:`verl_ext.eval.run.EvalConfig` (every field documented there).
"""

from __future__ import annotations

from pathlib import Path


def main() -> None:
    """The command: a refused setting (a typo, a value of the wrong type, a missing model or data
    file, an unknown benchmark) ends in one ``error:`` line; ``HETERORL_DEBUG=1`` shows the traceback."""
    import os

    import hydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from verl_ext.eval.run import config_from_mapping, run_evaluation

    from .export import is_run_dir, latest_export
    from .main_gepo import DEBUG_ENV, HYDRA_FULL_ERROR, hydra_refusal

    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")

    @hydra.main(config_path=str(Path(__file__).parent / "config"), config_name="evaluate", version_base=None)
    def _entry(dcfg) -> None:
        settings = OmegaConf.to_container(dcfg, resolve=True)
        try:
            cfg = config_from_mapping(settings)  # every setting checked before a model is loaded
            if cfg.model_path and is_run_dir(Path(cfg.model_path)):
                cfg = config_from_mapping({**settings, "model_path": str(latest_export(Path(cfg.model_path)))})
            run_evaluation(cfg)
        except (ValueError, FileNotFoundError) as err:
            if debug:
                raise
            raise SystemExit(f"error: {err}") from None

    own = HYDRA_FULL_ERROR not in os.environ
    if own:
        os.environ[HYDRA_FULL_ERROR] = "1"  # hydra raises what it would print
    try:
        _entry()
    except (HydraException, OmegaConfBaseException) as err:
        if debug or not own:
            raise
        defaults = lambda: OmegaConf.load(Path(__file__).parent / "config" / "evaluate.yaml")  # noqa: E731
        raise SystemExit(f"error: {hydra_refusal(err, defaults=defaults)}") from None
    finally:
        if own:
            os.environ.pop(HYDRA_FULL_ERROR, None)


if __name__ == "__main__":
    main()
