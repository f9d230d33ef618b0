"""The multi-turn rollout engine, trajectory records, rewards and tool execution."""
