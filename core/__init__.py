"""What every layer shares: errors, the job config, the Plan, codecs and atomic files."""
