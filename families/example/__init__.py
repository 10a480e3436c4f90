"""What every family's offline example builds on: the example record, small BPE, templates, tiny models."""
