"""Vision encoders of the vision-language families (images to the tokens that stand in for them)."""
