"""`prep errors`: why input rows became error rows (tokenize) or were left out of packs (pack)."""

from prep.errors.stage import error_summary

__all__ = ["error_summary"]
