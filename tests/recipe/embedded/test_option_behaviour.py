"""Behaviour of embedded-engine options that the option contract (recipe/gepo/options.py) says are
honoured and that no other test exercised: delayed rollouts, the fs transport's URL, the
measured-delay trace and the math task's data files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from recipe.gepo.sections import DelayConfig, HeteroConfig
from recipe.gepo.embedded.async_shared import transport_spec
from recipe.gepo.embedded.learner_actor import rollout_inbox_transport
from recipe.gepo.embedded.run_log import RunSettings
from recipe.gepo.embedded.tasks import Task
from recipe.gepo.sections import TaskConfig
from verl_ext.hetero.protocol import ROLLOUT_TOPIC
from verl_ext.hetero.transport import FsspecTransport


def test_delay_rollouts_hides_a_group_until_its_delay_has_passed(tmp_path):
    transport = FsspecTransport(str(tmp_path / "exchange"))
    transport.put(ROLLOUT_TOPIC, "g-1", b"group")
    plain = HeteroConfig(delay=DelayConfig(dist="constant", value=0.6))
    assert rollout_inbox_transport(plain, transport) is transport  # off: the learner reads directly
    assert transport.keys(ROLLOUT_TOPIC) == ["g-1"]

    delayed = HeteroConfig(delay=DelayConfig(dist="constant", value=0.6), delay_rollouts=True)
    inbox = rollout_inbox_transport(delayed, transport)
    assert inbox.keys(ROLLOUT_TOPIC) == []  # sent now, due in 0.6 s
    deadline = time.monotonic() + 5.0
    while not inbox.keys(ROLLOUT_TOPIC) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert inbox.keys(ROLLOUT_TOPIC) == ["g-1"]
    assert inbox.get(ROLLOUT_TOPIC, "g-1") == b"group"


def _settings(run_dir: Path) -> RunSettings:
    return RunSettings(
        model_path="",
        prompts_per_step=2,
        total_steps=1,
        group_size=2,
        temperature=1.0,
        max_new_tokens=4,
        run_dir=run_dir,
        save_freq=0,
        test_freq=0,
        resume_mode="disable",
        loggers=[],
        project_name="p",
        experiment_name="e",
    )


def test_transport_url_is_where_the_fs_transport_exchanges(tmp_path):
    url = str(tmp_path / "shared")
    spec = transport_spec(HeteroConfig(transport="fs", transport_url=url), _settings(tmp_path / "run"))
    assert spec.url == url
    default = transport_spec(HeteroConfig(transport="fs"), _settings(tmp_path / "run"))
    assert default.url == str((tmp_path / "run" / "exchange").resolve())
    spec.open().put(ROLLOUT_TOPIC, "k", b"x")
    assert (Path(url) / ROLLOUT_TOPIC).is_dir()


def test_trace_path_and_column_replay_the_measured_delays(tmp_path):
    trace = tmp_path / "delays.csv"
    trace.write_text("host,seconds\na,3.5\nb,7.25\nc,11.0\n")
    model = DelayConfig(dist="trace", trace_path=str(trace), trace_column="seconds").build()
    draws = model.sample(200, np.random.default_rng(0))
    assert set(np.unique(draws)) == {3.5, 7.25, 11.0}


def test_math_task_reads_its_dataset_path_and_eval_dataset(tmp_path):
    train = tmp_path / "aime.jsonl"
    train.write_text(
        "".join(json.dumps({"problem": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(5))
    )
    config = TaskConfig(
        name="math", dataset="aime24", dataset_path=str(train), eval_dataset="math500", eval_size=3, template="plain"
    )
    task = Task(config, seed=0)
    prompts = {item["prompt"] for item in task.train_items(8, stream=1, index=0)}
    assert prompts and all("What is" in p for p in prompts)  # drawn from the file
    assert len(task.eval_items) == 3 and not any("What is" in it["prompt"] for it in task.eval_items)
    assert task.score("\\boxed{4}", {"answer": "4"}) == 1.0
