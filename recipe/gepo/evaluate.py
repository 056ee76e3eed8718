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
    import hydra
    from omegaconf import OmegaConf

    from verl_ext.eval.run import config_from_mapping, run_evaluation

    from .export import is_run_dir, latest_export

    @hydra.main(config_path="config", config_name="evaluate", version_base=None)
    def _entry(dcfg) -> None:
        settings = OmegaConf.to_container(dcfg, resolve=True)
        if settings.get("model_path") and is_run_dir(Path(settings["model_path"])):
            settings["model_path"] = str(latest_export(Path(settings["model_path"])))
        run_evaluation(config_from_mapping(settings))

    _entry()


if __name__ == "__main__":
    main()
