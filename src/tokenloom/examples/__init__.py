"""Examples that ship with tokenloom: the demo (``tokenloom demo``) runs the main job end to end."""
