"""The drafter service and its algorithms (NGRAM, STANDALONE, EAGLE, EAGLE3, MTP)."""
