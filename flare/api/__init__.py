"""The request path every API shares (parse into a `Generation`, prepare, answer through the API's
renderer), and a folder per API holding its parser and renderer: chat/, responses/, messages/,
tokenize/."""
