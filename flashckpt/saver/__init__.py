"""The saver process, its client, its persist jobs and the exporters it runs."""
