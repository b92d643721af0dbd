"""Parts of scripts/chaos.py: outcome accounting, the loopback mesh, the netns mesh."""
