"""New attention forms: gated delta-rule linear attention (and its family helpers)."""
