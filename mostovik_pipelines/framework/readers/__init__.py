"""Readers of the formats sources deliver in. They build frames (pandas, Arrow): a source's
transform imports its reader when it runs, so declaring the source stays light."""
