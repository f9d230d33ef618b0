"""Task identity: one definition, the same id in every run and process."""

from trajlab.rollout.types import task_id


def test_task_id_is_the_tasks_own_id_else_an_order_independent_content_hash():
    assert task_id({"task_id": "abc", "x": 1}) == "abc"
    assert task_id({"task_id": 7}) == "7"
    one, same = {"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"d": 3, "c": 2}, "a": 1}
    assert task_id(one) == task_id(same) and task_id(one).startswith("task-")
    assert task_id(one) != task_id({"a": 2, "b": {"c": 2, "d": 3}})
    # Pinned: eval.json files, datasets and episode ids hold these; a new hash would orphan them.
    assert task_id(one) == "task-f85d0f485672"
    assert task_id({"q": "naïve ✓", "n": 0.3}) == "task-265fae65718b"
