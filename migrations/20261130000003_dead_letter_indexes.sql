-- Keyset pages of open dead letters, newest first, overall and by class (the common filter).
CREATE INDEX dead_letters_open_page ON dead_letters (created_at DESC, id DESC)
    WHERE status = 'open';
CREATE INDEX dead_letters_open_class_page ON dead_letters (class, created_at DESC, id DESC)
    WHERE status = 'open';
CREATE INDEX operator_actions_dead_letter ON operator_actions (dead_letter_id, created_at);
